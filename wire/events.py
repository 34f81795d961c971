"""The wire contract between the engine and its observers (schema version 1). No torch.

Every event is a plain dataclass with ``to_dict()`` / ``from_dict()``; ``type`` names it on the
wire, and ``from_dict`` ignores fields it does not know (a newer engine must not break an older
reader). Event times are integers of monotonic nanoseconds (``time.monotonic_ns()`` in the engine
core process); a :class:`ClockAnchor` read once per engine turns them into wall-clock seconds.
A request's k-th token time is the ``end_ns`` of the step whose chunk for that request has
``produced_token`` set for the k-th time.

Order in the stream of one engine (causal): what happened before a step (``arrived``,
``aborted``, the ``control`` events that apply at that step, ``preempted``,
``first_scheduled``), then the ``step`` event, then what the step finished (``first_token``,
``finished``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

SCHEMA_VERSION = 1


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """The items of ``d`` that are init fields of the dataclass ``cls`` (drops ``type``, ``seq``
    and anything a newer writer added)."""
    names = {f.name for f in fields(cls) if f.init}
    return {k: v for k, v in d.items() if k in names}


@dataclass(frozen=True)
class ClockAnchor:
    """One pair of back-to-back reads of the wall clock and the monotonic clock (nanoseconds).

    ``to_wall`` maps a monotonic time of the same process (and, on Linux, of the same host) to
    wall-clock seconds since the epoch: ``(wall_ns + (t_ns - mono_ns)) / 1e9``.
    """

    wall_ns: int
    mono_ns: int

    @classmethod
    def now(cls) -> ClockAnchor:
        wall = time.time_ns()
        mono = time.monotonic_ns()
        return cls(wall_ns=wall, mono_ns=mono)

    def to_wall(self, t_ns: int) -> float:
        """Wall-clock seconds (float) of the monotonic time ``t_ns``."""
        return (self.wall_ns + (t_ns - self.mono_ns)) / 1e9

    def to_mono_ns(self, wall_s: float) -> int:
        """The monotonic nanoseconds of the wall-clock time ``wall_s`` (seconds since the
        epoch); the inverse of :meth:`to_wall` up to float rounding."""
        return self.mono_ns + round(wall_s * 1e9) - self.wall_ns

    def to_dict(self) -> dict[str, int]:
        return {"wall_ns": self.wall_ns, "mono_ns": self.mono_ns}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClockAnchor:
        return cls(**_known(cls, d))


@dataclass
class ChunkRecord:
    """One request's share of a step: ``num_tokens`` positions from ``start``.

    Not frozen: engines make one per chunk per step on their hot path, and a frozen dataclass
    costs ~2 us to build against ~0.4 (its ``__init__`` goes through ``object.__setattr__``).
    Treat it as immutable once its step is published."""

    request_id: str
    kind: str  # "prefill" | "decode"
    start: int
    num_tokens: int
    produced_token: bool
    # the long-prefill cap kept this chunk smaller (absent from older writers: False)
    capped: bool = False


@dataclass
class StepEvent:
    """One engine step that scheduled tokens. ``start_ns`` is read before scheduling,
    ``end_ns`` right after the model ran (the token time of every token the step produced);
    ``forward_ns`` is the part spent in the model forward and logits, the rest is overhead."""

    type: ClassVar[str] = "step"
    step: int
    start_ns: int
    end_ns: int
    token_budget: int
    policy: str
    num_decode_tokens: int
    num_prefill_tokens: int
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    chunks: list[ChunkRecord] = field(default_factory=list)
    forward_ns: int = 0
    # the long-prefill cap in force for this step (0 = off; absent from older writers: 0)
    long_prefill_token_threshold: int = 0

    @property
    def duration(self) -> float:
        """``end_ns - start_ns`` in seconds."""
        return (self.end_ns - self.start_ns) / 1e9

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepEvent:
        d = _known(cls, d)
        d["chunks"] = [ChunkRecord(**_known(ChunkRecord, c)) for c in d.get("chunks", [])]
        return cls(**d)


REQUEST_EVENT_KINDS = (
    "arrived",
    "first_scheduled",
    "first_token",
    "finished",
    "aborted",
    "preempted",
)


@dataclass
class RequestEvent:
    """A point in a request's life. ``finish_reason`` is set on ``finished`` and ``aborted``
    (an abort carries the reason it was asked with: ``abort``, or ``stop`` for a stop string
    the server matched)."""

    type: ClassVar[str] = "request"
    kind: str
    request_id: str
    time_ns: int
    traffic_class: str | None = None
    num_prompt_tokens: int = 0
    num_image_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestEvent:
        return cls(**_known(cls, d))


@dataclass
class ControlEvent:
    """A budget, policy or long-prefill cap change, accepted or refused (``reason`` says why).
    ``applied_at_step`` is the first step with the new value in force; ``request_id`` is the
    relay's control message id when the change came through the collector."""

    type: ClassVar[str] = "control"
    key: str
    old_value: Any
    new_value: Any
    accepted: bool
    time_ns: int
    source: str = "api"
    applied_at_step: int | None = None
    reason: str | None = None
    request_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlEvent:
        return cls(**_known(cls, d))


Event = StepEvent | RequestEvent | ControlEvent
_EVENT_TYPES: dict[str, type] = {
    "step": StepEvent,
    "request": RequestEvent,
    "control": ControlEvent,
}


def event_from_dict(d: dict[str, Any]) -> Event:
    kind = d.get("type")
    if kind not in _EVENT_TYPES:
        raise ValueError(f"unknown event type {kind!r}; expected one of {sorted(_EVENT_TYPES)}")
    return _EVENT_TYPES[kind].from_dict(d)  # type: ignore[attr-defined,no-any-return]
