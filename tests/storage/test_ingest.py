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


# ---- trust: identity, bounded seqs, bounded messages (issue 18) --------------------------------

SECRET = "s" * 32


def test_the_first_hello_of_a_run_registers_its_secret_and_later_ones_must_present_it() -> None:
    first = ingest.claim(registered=False, stored_hash=None, secret=SECRET)
    assert first.proven and first.register == ingest.secret_hash(SECRET) and not first.refused
    assert SECRET not in (first.register or "")  # the store keeps a hash, never the secret
    same = ingest.claim(registered=True, stored_hash=first.register, secret=SECRET)
    assert same.proven and same.register is None and not same.refused
    for wrong in ("x" * 32, None):
        other = ingest.claim(registered=True, stored_hash=first.register, secret=wrong)
        assert other.refused and not other.proven
    # Non-ASCII and odd types are refused with a reason, never raise.
    assert ingest.claim(registered=True, stored_hash=first.register, secret="é" * 20).refused
    assert ingest.claim(registered=False, stored_hash=None, secret=12345).refused
    assert ingest.claim(registered=False, stored_hash=None, secret="short").refused


def test_a_run_of_an_engine_without_a_secret_stays_unproven() -> None:
    legacy = ingest.claim(registered=False, stored_hash=None, secret=None)
    assert not legacy.proven and legacy.register is None and not legacy.refused
    # Nobody can bind it to a secret later, and nobody proves it.
    late = ingest.claim(registered=True, stored_hash=None, secret=SECRET)
    assert not late.proven and late.register is None and not late.refused


def test_only_a_proven_hello_replaces_a_live_connection() -> None:
    assert ingest.may_take_over(proven=True, live=True)
    assert ingest.may_take_over(proven=False, live=False)
    assert not ingest.may_take_over(proven=False, live=True)


def _gap(seq: int, first: int, last: int) -> dict[str, Any]:
    return {"type": "gap", "seq": seq, "first_seq_lost": first, "last_seq_lost": last}


def test_a_gap_may_not_jump_absurdly_far() -> None:
    top = 2**63 - 1
    msg = _frame(1)
    msg["events"].append(_gap(top, 2, top - 1))
    v = _verdict(msg)
    assert v.close is not None and v.expected == 1 and v.accepted == []  # nothing poisoned
    far = _frame(1)
    far["events"].append(_gap(ingest.MAX_GAP_EVENTS + 3, 2, ingest.MAX_GAP_EVENTS + 2))
    v = _verdict(far)
    assert [e["seq"] for e in v.accepted] == [1] and v.expected == 2
    assert v.error is not None and v.error["code"] == "seq_gap"
    ok = _frame(1)
    ok["events"].append(_gap(ingest.MAX_GAP_EVENTS + 2, 2, ingest.MAX_GAP_EVENTS + 1))
    assert _verdict(ok).expected == ingest.MAX_GAP_EVENTS + 3


def test_a_gap_must_start_at_the_hole() -> None:
    assert not ingest.declares(_gap(9, 4, 8), 3)  # starts after the hole: seq 3 undeclared
    assert not ingest.declares(_gap(9, 0, 8), 1)  # seqs start at 1
    assert not ingest.declares({**_gap(9, 3, 8), "first_seq_lost": 3.0}, 3)
    assert ingest.declares(_gap(9, 3, 8), 3) and ingest.declares(_gap(9, 3, 9), 3)


def test_frames_are_bounded_in_events() -> None:
    n = ingest.MAX_EVENTS_PER_FRAME
    assert _verdict(_frame(*range(1, n + 1))).close is None
    v = _verdict(_frame(*range(1, n + 2)))
    assert v.close is not None and "events in one frame" in v.close and v.accepted == []


def test_hellos_are_bounded() -> None:
    good = {"type": "hello", "schema": SCHEMA_VERSION, "engine_id": "e", "run_id": "r",
            "clock": {"wall_ns": 1, "mono_ns": 2}}  # fmt: skip
    assert ingest.check_hello_frame(json.dumps(good)) == (good, "")
    big = dict(good, config={"pad": "x" * ingest.MAX_HELLO_BYTES})
    hello, why = ingest.check_hello_frame(json.dumps(big))
    assert hello is None and "over" in why
    long_id = dict(good, engine_id="e" * (ingest.MAX_ID_CHARS + 1))
    assert "at most" in ingest.check_hello_frame(json.dumps(long_id))[1]
    assert "printable" in ingest.check_hello_frame(json.dumps(dict(good, run_id="r\n")))[1]


def test_a_refused_control_is_one_row_at_most() -> None:
    huge = {"type": "control", "engine_id": "e", "set": {f"k{i}": i for i in range(100_000)}}
    assert ingest.control_refusal_row(huge, "k0", known_engine=True) == (None, None)
    assert ingest.control_refusal_row(huge, "k0", known_engine=False) is None
    bad = {"type": "control", "set": {"token_budget": 0, "policy": "x"}}
    assert ingest.control_refusal_row(bad, "token_budget", known_engine=True) == (
        "token_budget",
        0,
    )
    nested = {"type": "control", "set": {"token_budget": {"a": [1] * 1000}}}
    assert ingest.control_refusal_row(nested, "token_budget", known_engine=True) == (
        "token_budget",
        None,
    )


def test_control_messages_are_bounded_before_parsing() -> None:
    msg = {"type": "control", "id": "c1", "engine_id": "e", "set": {"token_budget": 1}}
    assert ingest.check_control_message(json.dumps(msg)) == (msg, "")
    big = dict(msg, set={f"k{i}": i for i in range(ingest.MAX_CONTROL_BYTES // 8)})
    assert "over" in ingest.check_control_message(json.dumps(big))[1]
    assert "id" in ingest.check_control_message(json.dumps(dict(msg, id="i" * 500)))[1]


def test_engines_replies_are_paged_with_the_connected_first() -> None:
    rows = [{"engine_id": f"e{i}", "connected": i == 500} for i in range(1000)]
    page = ingest.engines_page(rows)
    assert len(page["engines"]) == ingest.MAX_ENGINES_LISTED and page["total"] == 1000
    assert page["engines"][0]["engine_id"] == "e500" and page["next_offset"] == 200
    assert len(json.dumps(page)) < 1 << 20
    last = ingest.engines_page(rows, 800)
    assert len(last["engines"]) == 200 and "next_offset" not in last
    assert ingest.engines_page(rows, True)["engines"][0]["engine_id"] == "e500"


def test_bad_events_get_one_reply_per_batch() -> None:
    reply = ingest.bad_events_reply([(i, "KeyError: 'end_ns'") for i in range(5, 5005)])
    assert reply["code"] == "bad_event" and reply["seq"] == 5 and reply["count"] == 5000
    assert "4999 more" in reply["message"]


def test_nan_infinity_and_deep_nesting_are_refused_with_a_reason() -> None:
    for constant in ("NaN", "Infinity", "-Infinity"):
        msg, why = ingest.parse('{"type": "control", "set": {"token_budget": ' + constant + "}}")
        assert msg is None and constant in why
    msg, why = ingest.parse("[" * 100_000 + "]" * 100_000)
    assert msg is None and ("deep" in why or "malformed" in why)


def test_a_number_beyond_a_float_is_refused_not_stored_as_infinity() -> None:
    frame = (
        f'{{"schema": {SCHEMA_VERSION}, "type": "events", "events": [{{"seq": 1, '
        '"type": "control", "key": "token_budget", "new_value": 1e999, "accepted": false}]}'
    )
    msg, why = ingest.parse(frame)
    assert msg is None and "finite" in why


def test_the_engines_remembered_are_bounded_and_connected_ones_kept() -> None:
    rows = {f"e{i}": {"connected": i % 2 == 0} for i in range(10)}
    assert ingest.seen_to_forget(rows, limit=10) == []
    assert ingest.seen_to_forget(rows, limit=7) == ["e1", "e3", "e5"]
    assert ingest.seen_to_forget(rows, limit=2) == ["e1", "e3", "e5", "e7", "e9"]


# ---- integers the store can hold (derived from storage/schema.py) ------------------------------

INT32, INT64 = 2**31 - 1, 2**63 - 1


def test_integer_bounds_come_from_the_column_types() -> None:
    # planted: every column taken as 64-bit (the store's old _int rule) fails the first line
    assert ingest.INT_RANGES["step"]["num_running"] == (-(2**31), INT32)
    assert ingest.INT_RANGES["step"]["start_ns"] == (-(2**63), INT64)
    assert ingest.INT_RANGES["request"]["num_prompt_tokens"] == (-(2**31), INT32)  # requests
    assert ingest.INT_RANGES["hello"]["token_budget"] == (-(2**31), INT32)


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"type": "step", "seq": 3, "num_running": INT32 + 1}, "num_running"),
        ({"type": "step", "seq": 3, "start_ns": INT64 + 1}, "start_ns"),
        ({"type": "request", "seq": 3, "num_output_tokens": -(2**31) - 1}, "num_output_tokens"),
        ({"type": "request", "seq": 3, "num_cached_tokens": INT32 + 1}, "num_cached_tokens"),
        ({"type": "gap", "seq": 3, "num_events_lost": INT64 + 1}, "num_events_lost"),
        (
            {
                "type": "control",
                "seq": 3,
                "key": "token_budget",
                "accepted": True,
                "new_value": INT32 + 1,
            },
            "token_budget",
        ),
    ],
)
def test_an_integer_its_column_cannot_hold_is_refused_with_a_reason(
    event: dict[str, Any], field: str
) -> None:
    why = ingest.integer_refusal(event)
    assert field in why and "outside what the store holds" in why


def test_integers_that_fit_pass() -> None:
    assert ingest.integer_refusal({"type": "step", "seq": 3, "num_running": INT32}) == ""
    assert ingest.integer_refusal({"type": "step", "seq": 3, "start_ns": INT64}) == ""
    refused_change = {
        "type": "control",
        "seq": 3,
        "key": "token_budget",
        "accepted": False,
        "new_value": INT32 + 1,
    }  # a refusal stores the value as JSON text only
    assert ingest.integer_refusal(refused_change) == ""
    assert ingest.integer_refusal({"type": "unknown", "x": 2**80}) == ""


def test_a_hello_with_an_integer_its_run_row_cannot_hold_is_refused() -> None:
    from testkit.engines import SyntheticEngine

    hello = SyntheticEngine(engine_id="e", run_id="r").hello()
    assert ingest.check_hello(hello) == ""
    assert "pid" in ingest.check_hello({**hello, "pid": INT32 + 1})
    assert "clock_wall_ns" in ingest.check_hello(
        {**hello, "clock": {**hello["clock"], "wall_ns": INT64 + 1}}
    )
