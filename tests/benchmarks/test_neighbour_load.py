"""benchmarks/neighbour_load.py end to end in its quick form: every arm measured, the helper
processes gone afterwards, bad CPU choices refused."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest


def test_quick_run_measures_every_arm(tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    mod = importlib.import_module("benchmarks.neighbour_load")
    before = os.sched_getaffinity(0)
    try:
        assert mod.main(["--quick", "--out-dir", str(tmp_path), "--core", str(cpus[0]),
                         "--other", str(cpus[1])]) == 0  # fmt: skip
    finally:
        os.sched_setaffinity(0, before)
    doc = json.loads((tmp_path / "neighbour_load.json").read_text())
    assert set(doc["per_arm"]) == {"idle", "spin", "stream"}
    assert all(v["steps"] > 0 and v["decode_step_p50_ms"] > 0 for v in doc["per_arm"].values())
    assert set(doc["ratios"]) == {"idle over idle", "spin over idle", "stream over idle"}


def test_refuses_the_same_cpu_twice() -> None:
    mod = importlib.import_module("benchmarks.neighbour_load")
    cpu = min(os.sched_getaffinity(0))
    with pytest.raises(SystemExit):
        mod.main(["--quick", "--core", str(cpu), "--other", str(cpu)])
