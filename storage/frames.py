"""The common telemetry frame, decoded at C speed: what ``wire.events`` defines for step and
request events, nothing else, in printable ASCII.

A 64-chunk step is about 7 KB of JSON; the standard library builds 64 dicts of it for about
200 us, more than the rest of its ingest. :func:`decode_plain` reads a frame whose events are
all step or request events with exactly the contract's fields (msgspec, typed: no dict per
chunk) into the same dicts as :func:`storage.ingest.parse`, except that each event is a
:class:`CheckedEvent` and a step's ``chunks`` a list of :class:`Chunk` objects. Any other
frame (another event type, an extra or missing field, a value of another type, a string
with an escape or outside printable ASCII, an int out of its column's range) gives None, and
the caller parses it with :func:`storage.ingest.parse` as before: the rules and their
refusals stay in one place.

What this decoder accepts is exactly what the general path would accept unchanged: the JSON
is valid (so neither NaN nor Infinity), nests five levels, every string is printable ASCII
(JSON escapes every control character, so a frame without a backslash or DEL holds none), at
most :data:`storage.ingest.MAX_TEXT_CHARS` long (so :func:`storage.ingest.clean_events` would
leave it as it is, and skips these events), and every int fits the
column the store keeps it in (:data:`storage.ingest.INT_RANGES`; a chunk's, its packed
field): the store takes such an event without checking each value again.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from storage.ingest import INT_RANGES, MAX_TEXT_CHARS

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]  # a packed chunk field
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]  # as clean_text leaves it


class Chunk(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One chunk of a step (``wire.events.ChunkRecord``)."""

    request_id: Text
    kind: Text
    start: Int32
    num_tokens: Int32
    produced_token: bool
    capped: bool = False


class CheckedEvent(dict[str, Any]):
    """An event as :func:`decode_plain` read it: a step or request event whose ints fit their
    columns and whose texts are clean strings (the store takes it without checking them
    again, :func:`storage.ingest.clean_events` leaves it alone); a
    step's ``chunks`` are :class:`Chunk` objects whose request ids are printable ASCII of at
    most ``MAX_TEXT_CHARS`` and whose ints fit their packed fields (the store packs them
    without per-chunk checks)."""

    __slots__ = ()


INT64_MAX = 2**63 - 1


def _bounded(kind: str, name: str) -> Any:
    """An int that fits the store's column ``name`` of ``kind`` events (ingest.INT_RANGES) and
    the store's 64-bit rule (``storage.store._int``): one that does not leaves the frame to the
    general path, whose refusal says why."""
    lo, hi = INT_RANGES[kind].get(name, (-INT64_MAX, INT64_MAX))
    return Annotated[int, msgspec.Meta(ge=max(lo, -INT64_MAX), le=min(hi, INT64_MAX))]


def _event(kind: str, required: dict[str, Any], optional: dict[str, Any]) -> Any:
    fields: list[Any] = [(name, t) for name, t in required.items()]
    fields += [(name, t | None, None) for name, t in optional.items()]
    return msgspec.defstruct(
        f"_{kind.title()}",
        fields,
        tag_field="type",
        tag=kind,
        forbid_unknown_fields=True,
        gc=False,
    )


# wire.events.StepEvent's counts, as the store writes them on each step's row
STEP_COUNTS = (
    "forward_ns",
    "num_decode_tokens",
    "num_prefill_tokens",
    "num_scheduled_tokens",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "num_preemptions",
)
# wire.events.StepEvent and RequestEvent: every int within what the store holds
_STEP_INTS = (*STEP_COUNTS, "token_budget", "long_prefill_token_threshold")
_Step = _event(
    "step",
    {
        **{name: _bounded("step", name) for name in ("seq", "step", "start_ns", "end_ns")},
        "chunks": list[Chunk],
    },
    {**{name: _bounded("step", name) for name in _STEP_INTS}, "policy": Text},
)
_Request = _event(
    "request",
    {"seq": _bounded("request", "seq"), "kind": Text, "request_id": Text},
    {
        **{
            name: _bounded("request", name)
            for name in (
                "time_ns",
                "num_prompt_tokens",
                "num_image_tokens",
                "num_output_tokens",
                "num_cached_tokens",
                "step",
            )
        },
        "traffic_class": Text,
        "finish_reason": Text,
    },
)


class _Frame(msgspec.Struct, forbid_unknown_fields=True):
    schema: int
    type: str
    events: list[_Step | _Request]  # type: ignore[valid-type]
    # absent, or a string (a null is the general path's to refuse)
    engine_id: str | msgspec.UnsetType = msgspec.UNSET
    run_id: str | msgspec.UnsetType = msgspec.UNSET


_DECODER = msgspec.json.Decoder(_Frame)
_asdict = msgspec.structs.asdict


def _plain(raw: str) -> bool:
    """Printable ASCII JSON text: no escape (a control character in a string is one), no DEL."""
    return raw.isascii() and "\\" not in raw and "\x7f" not in raw


def decode_plain(raw: str | bytes) -> dict[str, Any] | None:
    """``raw`` as :func:`storage.ingest.parse` reads it (its events :class:`CheckedEvent`, a
    step's chunks :class:`Chunk` objects), or None when it is not a plain frame of step and
    request events."""
    if type(raw) is not str or not _plain(raw):
        return None
    try:
        frame = _DECODER.decode(raw)
    except msgspec.DecodeError:
        return None
    events: list[dict[str, Any]] = []
    append = events.append
    for ev in frame.events:
        d = CheckedEvent(_asdict(ev))
        d["type"] = "step" if type(ev) is _Step else "request"
        append(d)
    msg: dict[str, Any] = {"schema": frame.schema, "type": frame.type, "events": events}
    if frame.engine_id is not msgspec.UNSET:
        msg["engine_id"] = frame.engine_id
    if frame.run_id is not msgspec.UNSET:
        msg["run_id"] = frame.run_id
    return msg
