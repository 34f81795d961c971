"""The overload rule (``advisor.overload``) and the three places that count its numbers: the
simulator's windows, the sweep's client records and the store's requests."""

from __future__ import annotations

import pytest

from advisor.overload import GROWTH_SHARE, MIN_GROWTH, WindowLoad, describe, judge, queue_grows
from advisor.simulate import EngineShape, SimRequest, figures, simulate
from loadgen.record import RequestRecord
from loadgen.sweep import window_figures


def test_failures_alone_make_a_window_overloaded() -> None:
    assert WindowLoad(arrived=30, queued_start=0, queued_end=0, failed=1).overloaded
    assert "1 of its 30 requests failed" in (WindowLoad(30, 0, 0, 1).reason() or "")
    assert not WindowLoad(30, 0, 0, 0).overloaded and WindowLoad(30, 0, 0).reason() is None


def test_queue_growth_against_arrivals() -> None:
    assert GROWTH_SHARE == pytest.approx(0.2) and MIN_GROWTH == 4
    assert queue_grows(10, 4) and not queue_grows(10, 3)  # at least MIN_GROWTH
    assert queue_grows(30, 7) and not queue_grows(30, 6)  # more than 20% of the arrivals
    assert not queue_grows(30, -5)  # a queue that shrank
    w = WindowLoad(30, 2, 12)
    assert w.overloaded and w.growth == 10 and "grew from 2 to 12" in (w.reason() or "")
    assert not WindowLoad(30, 10, 12).overloaded  # a queue that was already there


def test_judge_counts_the_queue_at_both_ends() -> None:
    arrivals = [0.0, 1.0, 2.0, 5.0, 6.0, 9.5]
    firsts = [0.5, 4.0, None, 5.2, 11.0, None]
    load = judge(arrivals, firsts, 3.0, 10.0, failed=0)
    # start (t=3): arrived 1.0 (first at 4.0) and 2.0 (never): 2; end (t=10): 2.0, 6.0, 9.5: 3
    assert (load.arrived, load.queued_start, load.queued_end) == (3, 2, 3)
    assert not load.overloaded


def test_describe_names_the_overloaded_windows() -> None:
    rows = [
        {"budget": 128, "overloaded": True, "overload_reason": "x"},
        {"budget": 512, "cap": 256, "overloaded": False},
    ]
    assert describe(rows) == "overloaded (not recommended): budget 128: x"
    assert describe(rows[1:]) is None


def _burst(n: int, gap_ms: int, prompt: int, out: int) -> list[SimRequest]:
    return [
        SimRequest(
            f"r{i}", i * gap_ms * 1_000_000, tuple(range(i * 10**6, i * 10**6 + prompt)), out
        )
        for i in range(n)
    ]


def test_simulated_windows_are_judged() -> None:
    shape = EngineShape(num_kv_blocks=100_000, block_size=16)
    # one request every 100 ms, each a 1,000-token prompt at 1 ms per prefill token: 1 s of work
    # per 100 ms of arrivals - the queue grows for as long as the window lasts
    reqs = _burst(40, 100, 1000, 2)
    slow = simulate(reqs, shape, token_budget=512, step_ns=lambda p: p.num_scheduled_tokens * 10**6)
    f = figures(slow, since_ns=0, until_ns=4_000_000_000)
    assert f["overloaded"] and f["queued_end"] > 20
    fast = simulate(reqs, shape, token_budget=512, step_ns=lambda p: p.num_scheduled_tokens * 1000)
    g = figures(fast, since_ns=0, until_ns=4_000_000_000)
    assert not g["overloaded"] and g["overload_reason"] is None and g["itl_p999_ms"] is not None


def _record(i: int, send: float, first: float | None, status: str = "ok") -> RequestRecord:
    r = RequestRecord(index=i, traffic_class="chat", scheduled_s=0.0, max_tokens=4,
                      planned_prompt_tokens=10)  # fmt: skip
    r.send_wall, r.status = send, status
    if first is not None:
        r.chunk_wall = [first, first + 0.05]
        r.itl_s = [0.05]
        r.ttft_s = first - send
    return r


def test_sweep_windows_are_judged() -> None:
    steady = [_record(i, 100.0 + i * 0.5, 100.2 + i * 0.5) for i in range(40)]
    f = window_figures(steady, 100.0, 120.0)
    assert not f["overloaded"] and f["requests_errored"] == 0
    # the same sends, the server falling behind: first chunks come later and later
    behind = [_record(i, 100.0 + i * 0.5, 100.2 + i * 1.5) for i in range(40)]
    g = window_figures(behind, 100.0, 120.0)
    assert g["overloaded"] and g["queued_end"] >= 20
    # one request that timed out in the window
    failed = [*steady[:-1], _record(39, 110.0, None, status="error")]
    failed[-1].e2e_s = 5.0  # failed at 115 s, inside the window
    h = window_figures(failed, 100.0, 120.0)
    assert h["overloaded"] and "failed or timed out" in h["overload_reason"]
    # failed after the window's end: not this window's failure
    failed[-1].e2e_s = 30.0
    assert not window_figures(failed, 100.0, 120.0)["overloaded"]
    # cancelled by the load generator's own drain inside the window: cut, not failed
    failed[-1].e2e_s, failed[-1].error = 5.0, "cancelled: not finished within the 2 s drain"
    assert not window_figures(failed, 100.0, 120.0)["overloaded"]
