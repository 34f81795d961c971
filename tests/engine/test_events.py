"""The engine's event stream: wire form, causal order, monotonic ns times, controls from other
threads, abort reasons. Real ``tiny`` engines, no hand-made streams (except for the wire form)."""

from __future__ import annotations

import threading

import pytest

from engine.core.sampling_params import SamplingParams
from wire.events import (
    ChunkRecord,
    ClockAnchor,
    ControlEvent,
    RequestEvent,
    StepEvent,
    event_from_dict,
)

BEFORE_STEP = ("arrived", "aborted", "preempted", "first_scheduled")
AFTER_STEP = ("first_token", "finished")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 37 + i * 11) % 256 for i in range(n)]


def _run(engine) -> list[object]:
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return []
        engine.step()
    raise AssertionError("engine did not finish")


# --- wire form ------------------------------------------------------------------------------
def test_from_dict_ignores_fields_it_does_not_know() -> None:
    step = StepEvent(
        step=3,
        start_ns=10,
        end_ns=25,
        token_budget=64,
        policy="chunked",
        num_decode_tokens=1,
        num_prefill_tokens=8,
        num_scheduled_tokens=9,
        num_running=2,
        num_waiting=0,
        kv_blocks_used=3,
        kv_blocks_total=10,
        num_preemptions=0,
        chunks=[ChunkRecord("r", "prefill", 0, 8, True)],
        forward_ns=7,
    )
    req = RequestEvent("finished", "r", 25, num_output_tokens=4, finish_reason="stop", step=3)
    ctl = ControlEvent("token_budget", 64, 32, True, 5, applied_at_step=4, request_id="c-1")
    for event in (step, req, ctl):
        d = event.to_dict()
        assert d["type"] == event.type
        d["seq"] = 17  # added by the publisher
        d["from_a_newer_engine"] = {"x": 1}
        if isinstance(event, StepEvent):
            d["chunks"][0]["new_chunk_field"] = True
        assert event_from_dict(d) == event
    assert step.duration == 15 / 1e9
    assert ctl.to_dict()["request_id"] == "c-1"
    assert ControlEvent("policy", "a", "b", False, 1).request_id is None
    with pytest.raises(ValueError, match="unknown event type"):
        event_from_dict({"type": "nope"})


def test_clock_anchor_maps_monotonic_ns_to_wall_seconds() -> None:
    anchor = ClockAnchor(wall_ns=1_764_577_800_000_000_000, mono_ns=5_000_000_000)
    assert anchor.to_wall(5_000_000_000) == 1_764_577_800.0
    assert anchor.to_wall(6_500_000_000) == 1_764_577_801.5
    assert anchor.to_mono_ns(1_764_577_801.5) == 6_500_000_000
    assert ClockAnchor.from_dict({**anchor.to_dict(), "extra": 1}) == anchor
    now = ClockAnchor.now()
    assert isinstance(now.wall_ns, int) and isinstance(now.mono_ns, int)


# --- order and times of a real engine -------------------------------------------------------
def test_stream_is_causal_and_times_are_monotonic_ns(make_engine) -> None:
    engine = make_engine(token_budget=24, num_kv_blocks=8, block_size=8)
    stream: list[object] = []
    engine.add_listener(stream.append)
    outputs: dict[str, list[float]] = {}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rids = [engine.add_request(_prompt(8 + 5 * i, i), params) for i in range(4)]
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            outputs.setdefault(out.request_id, []).extend(out.token_times)
        if len(outputs) == 1 and "late" not in outputs:  # one arrival while others run
            rids.append(engine.add_request(_prompt(9, 9), params, request_id="late"))
            outputs["late"] = []

    steps = [e for e in stream if isinstance(e, StepEvent)]
    assert [s.step for s in steps] == list(range(len(steps)))  # no index without a step
    assert all(s.start_ns <= s.forward_ns + s.start_ns <= s.end_ns for s in steps)
    assert all(a.end_ns <= b.start_ns for a, b in zip(steps, steps[1:], strict=False))
    pos = {id(e): i for i, e in enumerate(stream)}
    step_pos = {s.step: pos[id(s)] for s in steps}
    seen: dict[str, list[str]] = {}
    for i, e in enumerate(stream):
        if isinstance(e, StepEvent):
            for c in e.chunks:  # every request in a step arrived (and was scheduled) before it
                assert {"arrived", "first_scheduled"} <= set(seen.get(c.request_id, []))
        elif isinstance(e, RequestEvent):
            assert isinstance(e.time_ns, int)
            seen.setdefault(e.request_id, []).append(e.kind)
            if e.kind in BEFORE_STEP and e.step is not None:
                assert i < step_pos[e.step]
            if e.kind in AFTER_STEP:
                assert i > step_pos[e.step]
                assert e.time_ns == steps[e.step].end_ns
    preempted = {rid for rid, kinds in seen.items() if "preempted" in kinds}
    for rid in rids:
        kinds = [k for k in seen[rid] if k != "preempted"]
        assert kinds == ["arrived", "first_scheduled", "first_token", "finished"]
    assert preempted, "8 blocks of 8 should force a preemption"
    # the k-th token time in the outputs is the wall time of the step that produced it
    anchor = engine.clock_anchor
    for rid in rids:
        ends = [
            s.end_ns for s in steps for c in s.chunks if c.request_id == rid and c.produced_token
        ]
        assert outputs[rid] == [anchor.to_wall(t) for t in ends]
        assert len(ends) == 6


def test_outputs_times_come_from_the_same_reads(make_engine) -> None:
    engine = make_engine()
    stream: list[object] = []
    engine.add_listener(stream.append)
    rid = engine.add_request(_prompt(10), SamplingParams(max_tokens=2, ignore_eos=True))
    outs = [o for _ in range(2) for o in engine.step().outputs]
    anchor = engine.clock_anchor
    by_kind = {e.kind: e for e in stream if isinstance(e, RequestEvent)}
    last = outs[-1]
    assert last.request_id == rid and last.finished
    assert last.arrival_time == anchor.to_wall(by_kind["arrived"].time_ns)
    assert last.first_scheduled_time == anchor.to_wall(by_kind["first_scheduled"].time_ns)
    assert last.first_token_time == anchor.to_wall(by_kind["first_token"].time_ns)


def test_arrival_given_as_monotonic_ns_or_wall_seconds(make_engine) -> None:
    engine = make_engine()
    stream: list[object] = []
    engine.add_listener(stream.append)
    anchor = engine.clock_anchor
    params = SamplingParams(max_tokens=1)
    engine.add_request(_prompt(5), params, request_id="ns", arrival_ns=anchor.mono_ns + 123)
    engine.add_request(_prompt(5), params, request_id="wall", arrival_time=anchor.to_wall(456))
    with pytest.raises(ValueError, match="not both"):
        engine.add_request(_prompt(5), params, arrival_time=1.0, arrival_ns=1)
    _run(engine)
    arrived = {e.request_id: e.time_ns for e in stream if getattr(e, "kind", "") == "arrived"}
    assert arrived["ns"] == anchor.mono_ns + 123  # exact
    assert abs(arrived["wall"] - 456) < 1000  # a float of epoch seconds holds ~0.24 us


# --- controls from other threads ------------------------------------------------------------
def test_budget_change_from_another_thread_sits_right_before_its_step(make_engine) -> None:
    engine = make_engine(token_budget=64, max_token_budget=512)
    for i in range(3):
        engine.add_request(_prompt(150, i), SamplingParams(max_tokens=20, ignore_eos=True))
    stream: list[object] = []
    engine.add_listener(stream.append)
    for _ in range(3):
        engine.step()
    replies: list[ControlEvent] = []
    emitted_on: list[int] = []
    engine.add_listener(
        lambda e: emitted_on.append(threading.get_ident()) if isinstance(e, ControlEvent) else None
    )
    t = threading.Thread(target=lambda: replies.append(engine.set_token_budget(16, "test")))
    t.start()
    t.join(10)
    reply = replies[0]
    assert reply.accepted and (reply.old_value, reply.new_value) == (64, 16)
    assert reply.applied_at_step == 3
    assert not any(isinstance(e, ControlEvent) for e in stream)  # not yet: held for the step
    _run(engine)
    i = next(i for i, e in enumerate(stream) if isinstance(e, ControlEvent))
    assert stream[i] is reply
    after = stream[i + 1]
    assert isinstance(after, StepEvent)
    assert after.step == reply.applied_at_step and after.token_budget == 16
    before = [e for e in stream[:i] if isinstance(e, StepEvent)]
    assert before[-1].token_budget == 64
    assert emitted_on == [threading.get_ident()]  # emitted by the step thread (this one)


def test_controls_reach_listeners_while_idle_in_order(make_engine) -> None:
    engine = make_engine(token_budget=64, max_token_budget=128)
    stream: list[object] = []
    engine.add_listener(stream.append)
    assert not engine.wait_for_work(0.01)  # this thread is the step thread
    replies: list[ControlEvent] = []

    def change() -> None:
        replies.append(engine.set_token_budget(500))  # refused: above max_token_budget
        replies.append(engine.set_policy("unchunked"))
        replies.append(engine.set_token_budget(32))

    t = threading.Thread(target=change)
    t.start()
    t.join(10)
    assert stream == []
    assert not engine.wait_for_work(5.0)  # returns at once: no work, events flushed
    assert stream == replies
    assert [(e.accepted, e.applied_at_step) for e in replies] == [
        (False, None),
        (True, 0),
        (True, 0),
    ]
    assert replies[0].reason and "500" in replies[0].reason
    assert all(isinstance(e.time_ns, int) for e in replies)
    # a change on the step thread itself is in place at once
    ev = engine.set_token_budget(48, request_id="ctl-7")
    assert stream[-1] is ev and ev.request_id == "ctl-7"
    engine.add_request(_prompt(10), SamplingParams(max_tokens=1))
    first = engine.step().event
    assert first is not None and first.step == 0 and first.token_budget == 48
    assert first.policy == "unchunked"


def test_idle_step_flushes_held_controls(make_engine) -> None:
    engine = make_engine()
    stream: list[object] = []
    engine.add_listener(stream.append)

    def change(value: str) -> None:
        t = threading.Thread(target=lambda: engine.set_policy(value))
        t.start()
        t.join(10)

    change("fast")  # before any step: no step thread yet, so it is emitted at once
    assert [(e.new_value, e.accepted) for e in stream] == [("fast", False)]
    assert engine.step().event is None  # an idle step: this thread now steps
    change("faster")
    assert len(stream) == 1  # held for the step thread
    assert engine.step().event is None
    assert [(e.new_value, e.accepted) for e in stream] == [("fast", False), ("faster", False)]


# --- abort reasons --------------------------------------------------------------------------
def test_abort_reason_is_the_finish_reason(make_engine) -> None:
    engine = make_engine()
    stream: list[object] = []
    engine.add_listener(stream.append)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    a = engine.add_request(_prompt(12, 1), params)
    b = engine.add_request(_prompt(12, 2), params)
    engine.step()
    engine.step()
    engine.abort_request(a, reason="stop")
    engine.abort_request(b)
    outs = engine.step().outputs
    finals = {o.request_id: (o.finished, o.finish_reason, o.num_output_tokens) for o in outs}
    assert finals == {a: (True, "stop", 2), b: (True, "abort", 2)}
    aborted = {e.request_id: e.finish_reason for e in stream if getattr(e, "kind", "") == "aborted"}
    assert aborted == {a: "stop", b: "abort"}
    assert not engine.has_unfinished_requests() and engine.stats().kv_blocks_used == 0
    with pytest.raises(TypeError, match="str"):
        engine.abort_request(a, reason=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        engine.abort_request(a, reason="")
