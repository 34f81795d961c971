"""The vLLM bridge's translation to events, with fakes: no vllm, no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from chunkscope.integrations.vllm_events import (
    BudgetControl,
    ScheduledChunk,
    StepTranslator,
    chunk_kind,
    external_request_id,
    finish_reason_name,
    traffic_class_of,
)
from wire.control import ControlRefused
from wire.events import ClockAnchor, ControlEvent, RequestEvent, StepEvent


def _translator() -> tuple[StepTranslator, list[Any]]:
    events: list[Any] = []
    return StepTranslator(events.append, ClockAnchor.now()), events


def _kinds(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, StepEvent):
            out.append(f"step{e.step}")
        elif isinstance(e, RequestEvent):
            out.append(f"{e.kind}:{e.request_id}")
        elif isinstance(e, ControlEvent):
            out.append(f"control@{e.applied_at_step}")
    return out


def _schedule(tr: StepTranslator, chunks: list[ScheduledChunk], **kw: Any) -> int | None:
    args: dict[str, Any] = dict(
        start_ns=1_000, token_budget=64, chunks=chunks, preempted=[], num_running=len(chunks),
        num_waiting=0, kv_blocks_used=3, kv_blocks_total=100,
    )  # fmt: skip
    args.update(kw)
    return tr.scheduled(**args)


def test_external_ids_are_what_the_openai_client_sees() -> None:
    assert external_request_id("cmpl-4f2a9c-0-1a2b3c4d") == "cmpl-4f2a9c"
    assert external_request_id("cmpl-4f2a9c-2-1a2b3c4d") == "cmpl-4f2a9c-2"
    assert external_request_id("chatcmpl-77aa-deadbeef") == "chatcmpl-77aa"
    assert external_request_id("my-header-id-0badf00d") == "my-header-id"
    assert external_request_id("chatcmpl-77aa", randomized=False) == "chatcmpl-77aa"
    assert external_request_id("cmpl-x-0", randomized=False) == "cmpl-x"


def test_the_traffic_class_comes_from_vllm_xargs_by_the_header_rule() -> None:
    assert traffic_class_of({"traffic_class": " RAG "}) == "rag"
    assert traffic_class_of({"traffic_class": "chat:v2"}) == "chat:v2"
    for bad in (None, {}, {"traffic_class": 3}, {"traffic_class": "a b"},
                {"traffic_class": "x" * 33}, {"traffic_class": ""}, ["traffic_class"]):  # fmt: skip
        assert traffic_class_of(bad) is None  # type: ignore[arg-type]
    tr, events = _translator()
    tr.arrived("cmpl-a-0-1a2b3c4d", None, 5, traffic_class="chat")
    tr.arrived("cmpl-b-0-1a2b3c4d", None, 5)
    assert [(e.request_id, e.traffic_class) for e in events] == [
        ("cmpl-a", "chat"), ("cmpl-b", None),
    ]  # fmt: skip


def test_chunk_kinds_and_finish_reasons() -> None:
    assert chunk_kind(0, 100, 100, 100) == "prefill"
    assert chunk_kind(100, 1, 100, 101) == "decode"
    assert chunk_kind(64, 1, 100, 101) == "prefill"  # last prompt token alone: still prefill
    assert chunk_kind(100, 8, 100, 120) == "prefill"  # recomputation after a preemption
    assert [finish_reason_name(i) for i in range(5)] == [
        "stop", "length", "abort", "error", "repetition",
    ]  # fmt: skip
    assert finish_reason_name(None) is None


def test_a_request_told_in_causal_order_with_exact_token_times() -> None:
    tr, events = _translator()
    tr.arrived("cmpl-a-0-11111111", None, 100)
    assert _schedule(tr, [ScheduledChunk("cmpl-a-0-11111111", 0, 64, 100, 100)]) == 1
    tr.executed(end_ns=2_000, produced={}, finished={})
    assert _schedule(tr, [ScheduledChunk("cmpl-a-0-11111111", 64, 36, 100, 100)]) == 2
    tr.executed(end_ns=3_000, produced={"cmpl-a-0-11111111": 1}, finished={})
    # nothing scheduled (e.g. everything waits on blocks): no step index is spent
    assert _schedule(tr, []) is None
    assert _schedule(tr, [ScheduledChunk("cmpl-a-0-11111111", 100, 1, 100, 101)]) == 3
    tr.executed(
        end_ns=4_000, produced={"cmpl-a-0-11111111": 1}, finished={"cmpl-a-0-11111111": 1},
        num_running=0, num_waiting=0,
    )  # fmt: skip
    assert _kinds(events) == [
        "arrived:cmpl-a", "first_scheduled:cmpl-a", "step1", "step2", "first_token:cmpl-a",
        "step3", "finished:cmpl-a",
    ]  # fmt: skip
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [c.produced_token for s in steps for c in s.chunks] == [False, True, True]
    # the queues after the step (the finished request left them), as the native engine's
    assert [(s.num_running, s.num_waiting) for s in steps] == [(1, 0), (1, 0), (0, 0)]
    assert [s.chunks[0].kind for s in steps] == ["prefill", "prefill", "decode"]
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        (64, 0), (36, 0), (0, 1),
    ]  # fmt: skip
    first = next(e for e in events if isinstance(e, RequestEvent) and e.kind == "first_token")
    assert first.time_ns == steps[1].end_ns == 3_000 and first.step == 2
    done = events[-1]
    assert done.finish_reason == "length" and done.num_output_tokens == 2


def test_plain_tuples_tell_the_same_steps_as_scheduled_chunks() -> None:
    """vllm.py hands the translator plain tuples (no object per chunk on vLLM's busy loop): the
    events, chunk by chunk, equal those told from ScheduledChunk objects, and a chunk whose
    request was aborted during the step produced no token."""
    told = []
    for make in (ScheduledChunk, lambda *a: tuple(a)):
        tr, events = _translator()
        for r in ("cmpl-a-0-11111111", "cmpl-b-0-22222222", "cmpl-c-0-33333333"):
            tr.arrived(r, None, 8)
        _schedule(
            tr,
            [
                make("cmpl-a-0-11111111", 0, 8, 8, 8),
                make("cmpl-b-0-22222222", 0, 4, 8, 8),
                make("cmpl-c-0-33333333", 2, 6, 8, 8),
            ],
            long_prefill_token_threshold=4,
        )
        tr.aborted(["cmpl-c-0-33333333"])
        tr.executed(
            end_ns=5_000,
            forward_start_ns=4_000,
            produced={"cmpl-a-0-11111111": 1, "cmpl-c-0-33333333": 1},
            finished={},
            num_running=2,
            num_waiting=1,
        )
        _schedule(
            tr, [make("cmpl-a-0-11111111", 8, 1, 8, 9), make("cmpl-b-0-22222222", 4, 4, 8, 8)]
        )
        tr.executed(
            end_ns=7_000,
            produced={"cmpl-a-0-11111111": 1, "cmpl-b-0-22222222": 1},
            finished={"cmpl-a-0-11111111": 0},
        )
        # arrivals and aborts carry the time they were told (now): not part of the comparison
        now = ("arrived", "aborted")
        told.append([{**e.to_dict(), "time_ns": 0} if getattr(e, "kind", "") in now
                     else e.to_dict() for e in events])  # fmt: skip
    assert told[0] == told[1]
    steps = [e for e in told[1] if e["type"] == "step"]
    assert [[c["produced_token"] for c in s["chunks"]] for s in steps] == [
        [True, False, False], [True, True],
    ]  # fmt: skip
    assert [[c["kind"] for c in s["chunks"]] for s in steps] == [
        ["prefill", "prefill", "prefill"], ["decode", "prefill"],
    ]  # fmt: skip
    assert steps[0]["forward_ns"] == 1_000 and steps[0]["num_waiting"] == 1
    assert steps[0]["long_prefill_token_threshold"] == 4 and steps[1]["forward_ns"] == 0
    assert [(s["num_prefill_tokens"], s["num_decode_tokens"]) for s in steps] == [(18, 0), (4, 1)]
    kinds = [f"{e['kind']}:{e['request_id']}" if e["type"] == "request" else f"step{e['step']}"
             for e in told[1]]  # fmt: skip
    assert kinds[3:] == [
        "first_scheduled:cmpl-a", "first_scheduled:cmpl-b", "first_scheduled:cmpl-c", "step1",
        "first_token:cmpl-a", "aborted:cmpl-c", "step2", "first_token:cmpl-b", "finished:cmpl-a",
    ]  # fmt: skip


def test_an_abort_during_a_step_comes_after_that_step() -> None:
    tr, events = _translator()
    tr.arrived("r1-aaaaaaaa", None, 4)
    tr.arrived("r2-bbbbbbbb", None, 4)
    _schedule(
        tr, [ScheduledChunk("r1-aaaaaaaa", 0, 4, 4, 4), ScheduledChunk("r2-bbbbbbbb", 0, 4, 4, 4)]
    )
    tr.aborted(["r2-bbbbbbbb", "unknown-cccccccc"])  # while the step executes
    tr.executed(end_ns=5_000, produced={"r1-aaaaaaaa": 1}, finished={})
    assert _kinds(events)[-3:] == ["step1", "first_token:r1", "aborted:r2"]
    tr.aborted(["r1-aaaaaaaa"])  # between steps: at once
    assert _kinds(events)[-1] == "aborted:r1"
    assert not tr.knows("r1-aaaaaaaa") and not tr.knows("r2-bbbbbbbb")


def test_preemptions_come_before_the_step_and_are_counted() -> None:
    tr, events = _translator()
    tr.arrived("r1-aaaaaaaa", None, 8)
    tr.arrived("r2-bbbbbbbb", None, 8)
    _schedule(
        tr, [ScheduledChunk("r1-aaaaaaaa", 0, 8, 8, 8), ScheduledChunk("r2-bbbbbbbb", 0, 8, 8, 8)]
    )
    tr.executed(end_ns=2_000, produced={"r1-aaaaaaaa": 1, "r2-bbbbbbbb": 1}, finished={})
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 8, 1, 8, 9)], preempted=["r2-bbbbbbbb"])
    tr.executed(end_ns=3_000, produced={"r1-aaaaaaaa": 1}, finished={})
    assert _kinds(events)[-2:] == ["preempted:r2", "step2"]
    assert events[-1].num_preemptions == 1


def test_budget_control_applies_at_the_next_step_and_says_so() -> None:
    tr, events = _translator()
    ctl = BudgetControl(tr, 256, ("chunked",))
    tr.arrived("r1-aaaaaaaa", None, 300)
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 0, 256, 300, 300)], token_budget=256)
    tr.executed(end_ns=2_000, produced={}, finished={})
    ans = ctl.request({"token_budget": 32}, source="collector", request_id="c1")
    assert ans == {"applied_at_step": 2, "old": {"token_budget": 256}, "new": {"token_budget": 32}}
    assert ctl.take() == {"token_budget": 32} and ctl.take() == {}  # written once, at the top
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 256, 32, 300, 300)], token_budget=32)
    tr.executed(end_ns=3_000, produced={}, finished={})
    assert _kinds(events)[-2:] == ["control@2", "step2"]
    ctl_event = events[-2]
    assert (ctl_event.old_value, ctl_event.new_value, ctl_event.request_id) == (256, 32, "c1")
    assert ctl_event.source == "collector" and ctl_event.accepted


def test_the_long_prefill_cap_is_relayed_to_vllm_and_carried_by_each_step() -> None:
    tr, events = _translator()
    ctl = BudgetControl(tr, 256, ("chunked",))
    tr.arrived("r1-aaaaaaaa", None, 300)
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 0, 256, 300, 300)], token_budget=256)
    tr.executed(end_ns=2_000, produced={}, finished={})
    ans = ctl.request({"long_prefill_token_threshold": 64}, source="collector", request_id="c2")
    assert ans["applied_at_step"] == 2 and ans["old"] == {"long_prefill_token_threshold": 0}
    assert ctl.take() == {"long_prefill_token_threshold": 64} and ctl.cap == 64
    _schedule(
        tr,
        [ScheduledChunk("r1-aaaaaaaa", 256, 44, 300, 300)],
        token_budget=256,
        long_prefill_token_threshold=64,
    )
    tr.executed(end_ns=3_000, produced={}, finished={})
    control, step = events[-2], events[-1]
    assert isinstance(control, ControlEvent) and control.key == "long_prefill_token_threshold"
    assert (control.old_value, control.new_value, control.applied_at_step) == (0, 64, 2)
    assert isinstance(step, StepEvent) and step.long_prefill_token_threshold == 64


@pytest.mark.parametrize(
    ("changes", "wording"),
    [
        ({"token_budget": 0}, "token_budget must be from 1 to 256, got 0"),
        ({"token_budget": 257}, "from 1 to 256, got 257"),
        ({"token_budget": 1.5}, "token_budget must be an integer"),
        ({"long_prefill_token_threshold": 257}, "long_prefill_token_threshold must be from 0 to"),
        ({"long_prefill_token_threshold": -1}, "from 0 to 256, got -1"),
        ({"policy": "unchunked"}, "policy must be one of chunked, got 'unchunked'"),
        ({"max_num_seqs": 4}, "unknown key 'max_num_seqs'"),
    ],
)
def test_budget_control_refuses_bad_values_and_changes_nothing(
    changes: dict[str, Any], wording: str
) -> None:
    tr, events = _translator()
    ctl = BudgetControl(tr, 256, ("chunked",))
    with pytest.raises(ControlRefused, match=wording.replace("(", r"\(").replace(")", r"\)")):
        ctl.request(changes, source="collector", request_id="c9")
    assert ctl.take() == {} and ctl.budget == 256 and ctl.cap == 0
    _schedule(tr, [ScheduledChunk("r-aaaaaaaa", 0, 4, 4, 4)])
    assert not [e for e in events if isinstance(e, ControlEvent)]


def test_translation_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, chunkscope.integrations.vllm_events\n"
        "bad = [m for m in ('vllm', 'torch') if m in sys.modules]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bridge_timing_reports_every_n_steps_and_its_share_of_step_time() -> None:
    from chunkscope.integrations.vllm_events import BridgeTiming

    cpu = iter([1_000, 1_000 + 4 * 2_000, 9_000 + 3_000])  # publisher thread CPU clock (ns)
    t = BridgeTiming(4, lambda: next(cpu))
    lines = [t.add(ns, 1_000_000) for ns in (10_000, 20_000, 30_000, 100_000)]
    assert lines[:3] == [None, None, None]
    line = lines[3]
    assert line is not None
    # mean 40 us, p50 the upper middle (30 us), p99 the largest; 160 us of 4 ms of steps = 4%
    assert "over 4 steps" in line and "mean 40.0 us" in line and "p50 30.0 us" in line
    assert "p99 100.0 us" in line and "4.000% of step wall time" in line
    assert "publisher thread CPU 2.0 us per step (0.200%)" in line
    # afresh after a report
    assert t.add(5_000, 1_000_000) is None
    last = t.summary() or ""
    assert "over 1 steps" in last and "CPU 3.0 us per step" in last


def test_bridge_timing_without_publisher_clock() -> None:
    from chunkscope.integrations.vllm_events import BridgeTiming

    t = BridgeTiming(1, None)
    line = t.add(1_000, 0) or ""
    assert "mean 1.0 us" in line and "publisher" not in line
    assert t.summary() is None


def test_dp_identity_sees_vllms_independent_dense_ranks() -> None:
    from chunkscope.integrations.vllm_events import dp_identity

    assert dp_identity(1, 0, 0, "EngineCore") == (False, 0, 1)  # no data parallelism
    assert dp_identity(None, None, None, "MainProcess") == (False, 0, 1)
    # a dense model's ranks: size and rank reset to 1 / 0, the rank kept in data_parallel_index
    assert dp_identity(1, 0, 1, "EngineCore_DP1") == (True, 1, None)
    assert dp_identity(1, 0, 0, "EngineCore_DP0") == (True, 0, None)
    # an MoE model keeps the DP group: size and rank as configured
    assert dp_identity(4, 3, 3, "EngineCore_DP3") == (True, 3, 4)
    assert dp_identity(2, 1, None, "x") == (True, 1, 2)


def test_a_control_on_an_idle_vllm_is_published_at_once_and_one_during_a_step_after_it() -> None:
    """An idle vLLM may schedule nothing for hours, or be stopped first: the acknowledged change
    must reach the store now, not at a next step that may never come."""
    tr, events = _translator()
    ctl = BudgetControl(tr, 256, ("chunked",))
    tr.arrived("r1-aaaaaaaa", None, 300)
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 0, 256, 300, 300)], token_budget=256)
    tr.executed(end_ns=2_000, produced={}, finished={})
    ctl.request({"token_budget": 32}, source="collector", request_id="c1")
    assert _kinds(events)[-2:] == ["step1", "control@2"]  # idle: out at once
    # during a step: held until that step's event is out, then before the next step's
    _schedule(tr, [ScheduledChunk("r1-aaaaaaaa", 256, 32, 300, 300)], token_budget=32)
    ctl.request({"token_budget": 64}, source="collector", request_id="c2")
    assert _kinds(events)[-1] == "control@2"
    tr.executed(end_ns=3_000, produced={}, finished={})
    assert _kinds(events)[-2:] == ["step2", "control@3"]
