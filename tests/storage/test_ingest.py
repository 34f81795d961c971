"""The collector's ingest rules, fed frames directly: no server, no store, no socket."""

from __future__ import annotations

import json
from typing import Any

import pytest

from storage import ingest
from wire.events import SCHEMA_VERSION


def _frame(*seqs: int, **extra: Any) -> dict[str, Any]:
    events = [{"type": "step", "seq": s} for s in seqs]
    return {"schema": SCHEMA_VERSION, "type": "events", "engine_id": "e", "run_id": "r",
            "events": events, **extra}  # fmt: skip


def _verdict(msg: dict[str, Any], expected: int = 1) -> ingest.Verdict:
    return ingest.frame(msg, engine_id="e", run_id="r", expected=expected)


def test_in_order_events_are_accepted_and_advance_the_expected_seq() -> None:
    v = _verdict(_frame(1, 2, 3))
    assert [e["seq"] for e in v.accepted] == [1, 2, 3] and v.expected == 4
    assert v.error is None and v.close is None and v.duplicates == 0


def test_duplicates_are_dropped_and_counted() -> None:
    v = _verdict(_frame(3, 4, 5, 6), expected=5)
    assert [e["seq"] for e in v.accepted] == [5, 6] and v.duplicates == 2 and v.expected == 7


def test_a_hole_stops_the_frame_and_asks_for_a_resend() -> None:
    v = _verdict(_frame(1, 2, 4, 5))
    assert [e["seq"] for e in v.accepted] == [1, 2] and v.expected == 3
    assert v.error is not None and v.error["code"] == "seq_gap" and v.error["expected"] == 3


def test_a_declared_gap_may_jump() -> None:
    gap = {"type": "gap", "seq": 9, "first_seq_lost": 3, "last_seq_lost": 8}
    msg = _frame(1, 2)
    msg["events"].append(gap)
    v = _verdict(msg)
    assert [e["seq"] for e in v.accepted] == [1, 2, 9] and v.expected == 10 and v.error is None
    short = dict(gap, last_seq_lost=7)  # declares too little: still a hole
    assert ingest.declares(gap, 3) and not ingest.declares(short, 3)


def test_seqs_must_increase_within_a_frame() -> None:
    v = _verdict(_frame(1, 3, 2))
    assert v.accepted == [] and v.error is not None and v.error["code"] == "seq_order"


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        (_frame(1, schema=SCHEMA_VERSION + 1), "not supported"),
        (_frame(1, engine_id="other"), "engine_id differs"),
        (_frame(1, run_id="other"), "run_id differs"),
        ({"schema": SCHEMA_VERSION, "type": "events", "events": [{"seq": True}]}, "integer seq"),
        ({"schema": SCHEMA_VERSION, "type": "events", "events": "x"}, "integer seq"),
    ],
)
def test_bad_frames_close_the_connection(msg: dict[str, Any], why: str) -> None:
    v = _verdict(msg)
    assert v.close is not None and why in v.close and v.accepted == []


def test_unknown_messages_get_an_error_and_control_acks_are_routed() -> None:
    v = _verdict({"schema": SCHEMA_VERSION, "type": "nope"})
    assert v.error is not None and v.error["code"] == "unknown_message" and v.close is None
    ack = {"type": "control_ack", "id": "c1", "ok": True}
    assert _verdict(ack).control_ack == ack


def test_hello_rules() -> None:
    good = {"type": "hello", "schema": SCHEMA_VERSION, "engine_id": "e", "run_id": "r",
            "clock": {"wall_ns": 1, "mono_ns": 2}}  # fmt: skip
    assert ingest.check_hello(good) == ""
    assert "first frame" in ingest.check_hello(dict(good, type="events"))
    assert "not supported" in ingest.check_hello(dict(good, schema=0))
    assert "engine_id" in ingest.check_hello(dict(good, engine_id=""))
    assert "clock" in ingest.check_hello(dict(good, clock={"wall_ns": 1.5, "mono_ns": 2}))
    assert "pid" in ingest.check_hello(dict(good, pid=True))


def test_parse() -> None:
    assert ingest.parse(json.dumps({"a": 1})) == ({"a": 1}, "")
    assert ingest.parse(b"{}")[0] is None and ingest.parse("[1]")[0] is None
    assert "malformed" in ingest.parse("{")[1]
