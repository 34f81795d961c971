"""benchmarks/vllm_overhead.py's bookkeeping, without vLLM: balanced random pair orders, the
paired ratio and its interval, vLLM's /metrics read back, and the bridge's own timing line
parsed as the bridge writes it. No timing is asserted."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

from chunkscope.integrations.vllm_events import BridgeTiming


@pytest.fixture(scope="module")
def vo() -> ModuleType:
    return importlib.import_module("benchmarks.vllm_overhead")


def test_pair_orders_are_balanced_and_seeded(vo: ModuleType) -> None:
    order = vo.plan_order(20, 3)
    assert len(order) == 20 and all(set(p) == {"with", "without"} for p in order)
    assert sum(p[0] == "with" for p in order) == 10
    assert order == vo.plan_order(20, 3) and order != vo.plan_order(20, 4)
    assert len(vo.plan_order(5, 1)) == 5


def test_three_arm_orders_deal_every_permutation(vo: ModuleType) -> None:
    arms = ("with", "without", "with-idle")
    order = vo.plan_order(12, 5, arms)
    assert len(order) == 12 and all(sorted(g) == sorted(arms) for g in order)
    assert all(sum(g[0] == a for g in order) == 4 for a in arms)  # each arm first equally
    assert len(set(order)) == 6  # all six orders, twice each
    assert order == vo.plan_order(12, 5, arms) and order != vo.plan_order(12, 6, arms)


def test_arms_option_refuses_what_cannot_be_compared(vo: ModuleType) -> None:
    import argparse

    assert vo.parse_arms("with, without,with-idle") == ("with", "without", "with-idle")
    for bad in ("with", "with,with-idle", "with,without,with", "with,without,sidecar", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--arms"):
            vo.parse_arms(bad)


def test_stored_steps_reads_the_collectors_runs(vo: ModuleType, tmp_path) -> None:
    import sqlalchemy as sa

    from storage.schema import metadata, runs

    db = tmp_path / "c.db"
    eng = sa.create_engine(f"sqlite:///{db}")
    metadata.create_all(eng)
    base = {"clock_wall_ns": 0, "clock_mono_ns": 0, "started": 0.0}
    with eng.begin() as con:
        for row in (
            {"engine_id": "a", "run_id": "r1", "num_steps": 40, "last_step": 40},
            {"engine_id": "a", "run_id": "r2", "num_steps": 7, "last_step": 9,
             "num_gap_events": 1},
            {"engine_id": "b", "run_id": "r3", "num_steps": 0},
        ):  # fmt: skip
            con.execute(runs.insert(), {**base, **row})
    eng.dispose()
    got = vo.stored_steps(db)
    assert got == {
        "a": {"steps": 47, "last_step": 49, "gaps": 1},
        "b": {"steps": 0, "last_step": 0, "gaps": 0},
    }


def test_idle_priority_reaches_every_thread() -> None:
    import subprocess
    import sys

    from benchmarks.vllm_overhead import idle_priority

    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()\n"
    code += "print('up', flush=True)\ntime.sleep(30)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        idle_priority(child.pid)
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 2
        assert all(os.sched_getscheduler(int(t)) == os.SCHED_IDLE for t in tids)
    finally:
        child.kill()
        child.wait()


def test_paired_ratio_is_the_geometric_mean_with_an_interval(vo: ModuleType) -> None:
    with_ = [99.0, 198.0, 49.5, 990.0]
    without = [100.0, 200.0, 50.0, 1000.0]  # every pair 0.99 whatever its level
    r = vo.paired_ratio(with_, without)
    assert r["n_pairs"] == 4 and r["ratio"] == pytest.approx(0.99)
    assert r["ci95"] == pytest.approx([0.99, 0.99])
    noisy = vo.paired_ratio([100.0, 90.0, 110.0, 95.0], [100.0, 100.0, 100.0, 100.0])
    lo, hi = noisy["ci95"]
    assert lo < noisy["ratio"] < hi and lo < 1.0
    assert vo.paired_ratio([None, 1.0], [1.0, 0.0])["n_pairs"] == 0


METRICS_1 = """# HELP vllm:generation_tokens_total x
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="m"} 20.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 20.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 20.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.2
"""
METRICS_2 = (
    METRICS_1.replace(" 100.0", " 300.0")
    .replace('"0.01",model_name="m"} 10.0', '"0.01",model_name="m"} 110.0')
    .replace('"0.025",model_name="m"} 20.0', '"0.025",model_name="m"} 220.0')
    .replace('"+Inf",model_name="m"} 20.0', '"+Inf",model_name="m"} 220.0')
    .replace('_count{engine="0",model_name="m"} 20.0', '_count{engine="0",model_name="m"} 220.0')
    .replace("} 0.2", "} 3.2")
)


def test_server_figures_from_two_scrapes(vo: ModuleType) -> None:
    a, b = vo.parse_metrics(METRICS_1), vo.parse_metrics(METRICS_2)
    s = vo.server_window(a, b, 2.0)
    assert s["output_tokens_per_s"] == pytest.approx(100.0)
    assert s["itl_n"] == 200 and s["itl_mean_ms"] == pytest.approx(15.0)
    # 100 of 200 under 10 ms, the other 100 in (10, 25]: p99 is 98% into that bucket
    assert s["itl_p99_ms_buckets"] == pytest.approx(10 + 15 * 0.98)


def test_self_timing_reads_the_bridges_own_lines(vo: ModuleType) -> None:
    cpu = iter([0, 4_000, 8_000])
    t = BridgeTiming(2, lambda: next(cpu))
    log = "\n".join(
        [
            "INFO x " + (t.add(10_000, 1_000_000) or "") + (t.add(30_000, 1_000_000) or ""),
            "INFO y " + (t.add(50_000, 500_000) or "") + (t.add(50_000, 500_000) or ""),
        ]
    )
    got = vo.self_timing(log)
    assert [r["steps"] for r in got["lines"]] == [2, 2]
    assert got["lines"][0]["core_share_pct"] == pytest.approx(2.0)
    assert got["lines"][1]["core_share_pct"] == pytest.approx(10.0)
    assert got["core_share_pct"] == pytest.approx(6.0) and got["mean_us"] == pytest.approx(35.0)
    assert got["publisher_cpu_us"] == pytest.approx(2.0)
    assert vo.self_timing("nothing") == {"lines": []}


def test_tree_cpu_counts_descendants(vo: ModuleType) -> None:
    import os
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 30
        while vo.tree_cpu_s(child.pid) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.1)
        burnt = vo.tree_cpu_s(child.pid)
        assert burnt >= 0.05
        # this process's tree holds the child's CPU and its own
        own = os.times()
        assert vo.tree_cpu_s(os.getpid()) >= burnt + 0.5 * (own.user + own.system) - 0.05
    finally:
        child.kill()
        child.wait()


def test_bind_threads_moves_every_thread_of_a_process() -> None:
    import subprocess
    import sys

    from benchmarks.vllm_overhead import bind_threads

    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(30,)).start()\n"
    code += "print('up', flush=True)\ntime.sleep(30)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        cpu = min(os.sched_getaffinity(0))
        bind_threads(child.pid, {cpu})
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 2
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tids)
    finally:
        child.kill()
        child.wait()
