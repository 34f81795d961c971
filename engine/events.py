"""The wire contract between the engine and its observers (schema version 1). No torch.

Every event is a plain dataclass with ``to_dict()`` / ``from_dict()``; ``type`` names it on the
wire. A request's k-th token time is the ``end_time`` of the step whose chunk for that request
has ``produced_token`` set for the k-th time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ChunkRecord:
    """One request's share of a step: ``num_tokens`` positions from ``start``."""

    request_id: str
    kind: str  # "prefill" | "decode"
    start: int
    num_tokens: int
    produced_token: bool


@dataclass
class StepEvent:
    type: ClassVar[str] = "step"
    step: int
    start_time: float
    end_time: float
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
    forward_time: float = 0.0  # seconds in the model forward and logits; the rest is overhead

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepEvent:
        d = {k: v for k, v in d.items() if k != "type"}
        d["chunks"] = [ChunkRecord(**c) for c in d.get("chunks", [])]
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
    type: ClassVar[str] = "request"
    kind: str
    request_id: str
    time: float
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
        return cls(**{k: v for k, v in d.items() if k != "type"})


@dataclass
class ControlEvent:
    """A budget or policy change, accepted or refused (``reason`` says why)."""

    type: ClassVar[str] = "control"
    key: str
    old_value: Any
    new_value: Any
    accepted: bool
    time: float
    source: str = "api"
    applied_at_step: int | None = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["type"] = self.type
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControlEvent:
        return cls(**{k: v for k, v in d.items() if k != "type"})


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
