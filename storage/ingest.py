"""The collector's ingest rules, without I/O: what to do with a hello and with each frame.

The socket layer (``storage/collector.py``) feeds parsed frames in and carries the verdict out
(store the accepted events, send an error, close with a code); the rules here read no socket,
no store and no clock, so they are unit-tested without a server (``tests/storage/test_ingest.py``).
Rules (docs/telemetry.md): the first frame is a hello of this schema; after it, ``events`` frames
whose seqs increase; a seq below the expected one is a duplicate (dropped, counted); a seq above
it is a gap, unless a ``gap`` event declares the seqs lost; ``control_ack`` frames answer relayed
controls.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from wire.control import CAP_KEY
from wire.events import SCHEMA_VERSION

CLOSE_BAD_INPUT = 4400


def parse(raw: str | bytes) -> tuple[dict[str, Any] | None, str]:
    """A frame as a JSON object, or None and why not."""
    if isinstance(raw, bytes):
        return None, "binary frame: frames are JSON text"
    try:
        msg = json.loads(raw)
    except ValueError as exc:
        return None, f"malformed JSON: {exc}"
    if not isinstance(msg, dict):
        return None, f"a frame must be a JSON object, got {type(msg).__name__}"
    return msg, ""


def check_hello(h: dict[str, Any]) -> str:
    """Why ``h`` is not an acceptable hello ("" when it is)."""
    if h.get("type") != "hello":
        return "the first frame must be a hello"
    if h.get("schema") != SCHEMA_VERSION:
        return f"schema {h.get('schema')!r} not supported (this collector speaks {SCHEMA_VERSION})"
    for key in ("engine_id", "run_id"):
        if not isinstance(h.get(key), str) or not h[key]:
            return f"hello needs a non-empty string {key}"
    clock = h.get("clock")
    if not isinstance(clock, dict) or not all(
        isinstance(clock.get(k), int) and not isinstance(clock.get(k), bool)
        for k in ("wall_ns", "mono_ns")
    ):
        return "hello needs clock {wall_ns, mono_ns} as integers"
    for key in (
        "token_budget",
        "max_token_budget",
        CAP_KEY,
        "pid",
        "kv_blocks_total",
        "block_size",
    ):
        value = h.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"hello {key} must be an integer, got {value!r}"
    return ""


def declares(ev: dict[str, Any], expected: int) -> bool:
    """A gap event may jump over the seqs it declares lost."""
    if ev.get("type") != "gap":
        return False
    first, last = ev.get("first_seq_lost"), ev.get("last_seq_lost")
    return (
        isinstance(first, int)
        and isinstance(last, int)
        and first <= expected
        and last >= ev["seq"] - 1
    )


@dataclass
class Verdict:
    """What the socket layer does with one frame after the hello."""

    close: str | None = None  # close with CLOSE_BAD_INPUT and this reason
    control_ack: dict[str, Any] | None = None  # an answer to a relayed control
    error: dict[str, Any] | None = None  # an error reply to send; the connection stays
    accepted: list[dict[str, Any]] = field(default_factory=list)  # events to store, seq order
    expected: int = 1  # the next expected seq once ``accepted`` is stored
    duplicates: int = 0


def error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, **extra}


def frame(msg: dict[str, Any], *, engine_id: str, run_id: str, expected: int) -> Verdict:
    """The verdict on one parsed frame of the connection of ``engine_id`` / ``run_id`` whose
    next expected seq is ``expected``."""
    kind = msg.get("type")
    if kind == "control_ack":
        return Verdict(control_ack=msg, expected=expected)
    if msg.get("schema") != SCHEMA_VERSION:
        return Verdict(close=f"schema {msg.get('schema')!r} not supported", expected=expected)
    if kind != "events":
        return Verdict(
            error=error(
                "unknown_message",
                f"unknown message type {kind!r} on /ingest (after the hello: "
                "events or control_ack)",
            ),
            expected=expected,
        )
    for key, value in (("engine_id", engine_id), ("run_id", run_id)):
        if key in msg and msg[key] != value:
            return Verdict(close=f"{key} differs from the hello's", expected=expected)
    events = msg.get("events")
    if not isinstance(events, list) or not all(
        isinstance(e, dict) and isinstance(e.get("seq"), int) and not isinstance(e.get("seq"), bool)
        for e in events
    ):
        return Verdict(
            close="events must be a list of objects with an integer seq", expected=expected
        )
    seqs = [e["seq"] for e in events]
    if any(b <= a for a, b in itertools.pairwise(seqs)):
        return Verdict(
            error=error(
                "seq_order",
                "the seqs in a frame must increase; frame refused",
                expected=expected,
            ),
            expected=expected,
        )
    verdict = Verdict(expected=expected)
    for ev in events:
        seq = ev["seq"]
        if seq < verdict.expected:
            verdict.duplicates += 1
            continue
        if seq > verdict.expected and not declares(ev, verdict.expected):
            gap_at = verdict.expected
            verdict.error = error(
                "seq_gap", f"seq {gap_at} is missing; resend from it", expected=gap_at
            )
            break
        verdict.accepted.append(ev)
        verdict.expected = seq + 1
    return verdict
