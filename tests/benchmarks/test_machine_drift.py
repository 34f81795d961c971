"""benchmarks/machine_drift.py: the window medians find a slow span, and the quick run times
every kind of probe. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import machine_drift as bench


def test_window_ratios_find_a_slow_span() -> None:
    times = [0.5 * k for k in range(60)]  # 30 s, a probe every 0.5 s
    values = [13.0 if 10 <= t < 20 else 10.0 for t in times]
    wins = bench.window_ratios(times, values, 10.0)
    assert [w["start_s"] for w in wins] == [0.0, 10.0, 20.0]
    assert [round(w["ratio"], 2) for w in wins] == [1.0, 1.3, 1.0]
    assert all(w["probes"] == 20 for w in wins)


def test_window_ratios_leave_out_a_short_last_span() -> None:
    times = [0.0, 4.0, 8.0, 10.5, 12.0]  # the last span holds 2 s of a 10 s window
    wins = bench.window_ratios(times, [1.0, 1.0, 1.0, 5.0, 5.0], 10.0)
    assert len(wins) == 1


def test_window_ratios_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="window_s"):
        bench.window_ratios([0.0], [1.0], 0.0)
    with pytest.raises(ValueError, match="length"):
        bench.window_ratios([0.0, 1.0], [1.0], 1.0)
    assert bench.window_ratios([], [], 1.0) == []


def test_summarize_counts_the_windows_that_moved() -> None:
    probes = [
        {"t_s": float(t), "gemm_ms": 1.0, "prefill_ms": 1.2 if t >= 10 else 1.0,
         "decode_ms": 1.0, "steal_share": 0.01}
        for t in range(20)
    ]  # fmt: skip
    s = bench.summarize(probes, 5.0)
    assert s["gemm_ms"]["windows_beyond_10pct"] == 0
    assert s["prefill_ms"]["window_ratio_range"] == pytest.approx([1 / 1.1, 1.2 / 1.1])
    assert s["steal_share"]["mean"] == pytest.approx(0.01)


def test_quick_run_times_every_kind(tmp_path: Path) -> None:
    assert bench.main(["--quick", "--preset", "tiny", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "machine_drift.json").read_text())
    assert doc["probes"] and doc["config"]["preset"] == "tiny"
    for kind in bench.KINDS:
        assert all(p[kind] > 0 for p in doc["probes"])
        assert doc["summary"][kind]["windows"]
    shares = [p["steal_share"] for p in doc["probes"] if "steal_share" in p]
    assert all(0.0 <= s <= 1.0 for s in shares)


def test_refuses_bad_flags() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--duration", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--prefill", "0"])
