"""benchmarks/autopilot_nowcast.py and benchmarks/autopilot_tick.py on a simulated store whose
step times follow a known cost model exactly: the nowcast from earlier data finds the window's
figures, a tick's parts are timed, and the side-by-side run compares against a git revision.
No timing is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from advisor.simulate import EngineShape, cost_model_step_ns, simulate
from engine.core.cost_model import CostModel
from tests.advisor.helpers import random_requests, store_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """60 s of chat and RAG traffic at budget 256 on a simulated engine: 2 ms a step, 50 us a
    prefill token, 1 ms a decode token, no scatter; (the store's path, wall time of t = 0)."""
    path = tmp_path_factory.mktemp("nowcast") / "store.db"
    shape = EngineShape(num_kv_blocks=4000, block_size=16, max_num_seqs=64, max_token_budget=4096)
    reqs = random_requests(3, 120, prompt=(20, 900), output=(5, 40), spacing_ms=(200, 800))
    cost = CostModel(const=2e-3, prefill=50e-6, decode=1e-3, attn=0.0)
    res = simulate(
        reqs, shape, token_budget=256, step_ns=cost_model_step_ns(cost.predict),
        gap_ns=100_000, record_steps=True,
    )  # fmt: skip
    wall_ns = store_run(f"sqlite:///{path}", reqs, res, shape)
    return path, wall_ns / 1e9


def _log(path: Path, wall0: float, times: list[float], steady: bool = True) -> None:
    with path.open("w") as f:
        for t in times:
            d = {
                "time": wall0 + t, "kind": "hold", "budget": 256, "cap": 0,
                "previous_budget": 256, "previous_cap": 0, "observed": {"steady": steady},
            }  # fmt: skip
            f.write(json.dumps(d) + "\n")


def test_nowcast_from_earlier_data_finds_the_windows_figures(
    store: tuple[Path, float], tmp_path: Path
) -> None:
    from benchmarks import autopilot_nowcast as bench

    path, wall0 = store
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(path, run / "store.db")
    _log(run / "decisions-0-autopilot.jsonl", wall0, [35.0, 45.0, 55.0])
    _log(run / "decisions-1-autopilot.jsonl", wall0, [45.0], steady=False)  # changed: skipped
    out = tmp_path / "out"
    argv = ["--store", str(run / "store.db"), "--out-dir", str(out), "--stride", "1",
            "--lookback", "5", "--fit-window", "25", "--noise-windows", "0,10"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((out / "autopilot_nowcast.json").read_text())
    first, second = doc["runs"]
    assert second["ticks"] == [] and second["summary"]["W0"]["itl_error"]["num_ticks"] == 0
    assert [t["t_s"] for t in first["ticks"]] == [0.0, 10.0, 20.0]
    for w in ("W0", "W10"):
        s = first["summary"][w]
        # the steps follow the model exactly: the forecast is the window's own figures
        assert s["itl_error"]["num_ticks"] == 3 and s["itl_error"]["median"] < 0.05
        assert s["ttft_error"]["median"] < 0.05
    assert all(t["W10"]["noise_steps"] >= 50 for t in first["ticks"])
    assert all(t["W0"]["noise_steps"] == 0 for t in first["ticks"])


def test_nowcast_refuses_a_store_without_decision_logs(
    store: tuple[Path, float], tmp_path: Path
) -> None:
    from benchmarks import autopilot_nowcast as bench

    path, _ = store
    lonely = tmp_path / "store.db"
    shutil.copy(path, lonely)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--store", str(lonely), "--out-dir", str(tmp_path / "o")])
    assert exc.value.code == 2


def test_tick_cost_is_timed_per_part(store: tuple[Path, float], tmp_path: Path) -> None:
    from benchmarks import autopilot_tick as bench

    path, _ = store
    argv = ["--store", str(path), "--out-dir", str(tmp_path), "--max-ticks", "4",
            "--every", "10", "--budgets", "128,512", "--caps", "0"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "autopilot_tick.json").read_text())
    assert doc["num_settings"] == 2 and len(doc["ticks"]) == 4
    assert all(t["simulate"] > 0 and len(t["digest"]) == 16 for t in doc["ticks"])
    assert doc["ticks"][0]["fit"] > 0  # the first tick fits; later ones within 10 s reuse it
    assert Path(doc["packages"]) == REPO


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_tick_cost_against_a_revision_runs_both_trees(
    store: tuple[Path, float], tmp_path: Path
) -> None:
    from benchmarks import autopilot_tick as bench

    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    path, _ = store
    argv = ["--store", str(path), "--out-dir", str(tmp_path), "--max-ticks", "2",
            "--every", "10", "--budgets", "256", "--caps", "0", "--against", "HEAD",
            "--rounds", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "autopilot_tick.json").read_text())
    assert doc["against"]["commit"] == head.stdout.strip()
    this, other = doc["runs"]["this"][0], doc["runs"]["against"][0]
    assert Path(this["packages"]) == REPO and Path(other["packages"]) != REPO
    assert len(this["ticks"]) == len(other["ticks"]) == 2
    assert isinstance(doc["identical_predictions"], bool) and set(doc["speedup"]) == {
        "reads", "fit", "noise", "simulate"
    }  # fmt: skip
    # the temporary tree is gone
    listed = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "autopilot-tick-" not in listed


def test_tick_check_finds_the_window_figures_in_every_arm(
    store: tuple[Path, float], tmp_path: Path
) -> None:
    # the steps follow the model exactly and nothing scatters: each arm's tick is the store's
    # own figures, the moments are those with one setting through the look-back
    from benchmarks import autopilot_check as bench

    path, _ = store
    argv = ["--store", str(path), "--out-dir", str(tmp_path), "--every", "10",
            "--lookback", "5", "--fit-window", "25", "--noise-window", "10", "--draws", "2",
            "--warmup", "20"]  # fmt: skip
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "autopilot_check.json").read_text())
    [run] = doc["runs"]
    assert len(run["moments"]) >= 3
    assert all(m["setting"] == "budget 256 cap off" for m in run["moments"])
    for arm in bench.ARMS:
        s = doc["pooled"][arm]
        assert s["itl"]["num_moments"] == len(run["moments"])
        assert s["itl"]["median_error"] < 0.05 and s["ttft"]["median_error"] < 0.05
    # the "now" arm's look-back starts at a step boundary, at or before the others'
    assert all(m["now"]["since_shift_s"] <= 0 for m in run["moments"])


def test_tick_check_refuses_bad_flags_and_missing_stores(tmp_path: Path) -> None:
    from benchmarks import autopilot_check as bench

    for argv in (
        ["--store", str(tmp_path / "none.db")],
        ["--store", str(tmp_path / "none.db"), "--every", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            bench.main([*argv, "--out-dir", str(tmp_path / "o")])
        assert exc.value.code == 2
    assert not (tmp_path / "o").exists()


def test_the_before_arm_keeps_the_old_quantiles_and_window() -> None:
    # the ablation swaps the module functions for the arm and puts them back
    import advisor.autopilot_run as ar
    import advisor.fit as fit
    from benchmarks import autopilot_check as bench

    rare = [1.0] * 99 + [50.0]
    with bench.arm_code("before"):
        assert fit.mass_quantiles(rare, 10)[-1] == 50.0  # the maximum, one draw in 10
        assert (
            ar.prefill_progress(None, engine_id="e", run_id=None, request_ids={"x"}, until=0) == {}
        )
    assert fit.mass_quantiles(rare, 10) == [1.0] * 10  # restored: middles of equal shares
    assert ar.prefill_progress is not None and ar.prefill_progress.__name__ == "prefill_progress"
