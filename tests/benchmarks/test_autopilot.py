"""benchmarks/autopilot.py's bookkeeping, without an engine: the phases' bounds, the replay (the
same requests for a seed, image arrivals rescaled to the rate, every phase's traffic in its
phase), a request counting in the phase it was sent in, predictions from the ticks whose
look-back lies in the phase, the summary's targets. No timing is asserted."""

from __future__ import annotations

import importlib
import json
import random
from datetime import datetime
from pathlib import Path
from types import ModuleType

import pytest

from advisor.autopilot import AutopilotSlo
from loadgen.record import RequestRecord


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("benchmarks.autopilot")


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small folder in the layout of the public traces: Azure-style CSVs (TIMESTAMP,
    ContextTokens, GeneratedTokens; the code trace in bursts) and 35 ServeGen mm-image clients,
    each window as bursty as the real trace's worst (cv 12)."""
    root = tmp_path_factory.mktemp("traces")
    rng = random.Random(7)
    for name, burst in (("conv", 1), ("code", 8)):
        t, rows = 1_700_000_000.0, ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        for i in range(3000):
            t += rng.expovariate(1.0) if i % burst == 0 else 0.01
            stamp = datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
            rows.append(f"{stamp},{rng.randint(100, 4000)},{rng.randint(5, 300)}")
        (root / f"AzureLLMInferenceTrace_{name}.csv").write_text("\n".join(rows) + "\n")
    mm = root / "servegen-mm-image"
    mm.mkdir()
    dist = {
        "image_count": "{1: 0.8, 2: 0.2}",
        "text_tokens": "{40: 0.5, 120: 0.5}",
        "output_tokens": "{30: 0.7, 200: 0.3}",
    }
    for client in range(35):
        windows = {str(w): dist for w in (0, 600, 1200)}
        (mm / f"chunk-{client}-dataset.json").write_text(json.dumps(windows))
        csv_rows = [f"{w},0.2,12.0,Gamma,0.007,700" for w in (0, 600, 1200)]
        (mm / f"chunk-{client}-trace.csv").write_text("\n".join(csv_rows) + "\n")
    return root


def test_phase_bounds(bench: ModuleType) -> None:
    args = bench.build_parser().parse_args(["--phase-s", "20,35,35,20", "--traces-dir", "t"])
    assert bench.phase_bounds(args) == [
        ("quiet", 0.0, 20.0), ("rag", 20.0, 55.0), ("image", 55.0, 90.0), ("quiet2", 90.0, 110.0),
    ]  # fmt: skip
    args = bench.build_parser().parse_args(["--phase-s", "8", "--traces-dir", "t"])
    assert bench.phase_bounds(args)[-1] == ("quiet2", 24.0, 32.0)
    with pytest.raises(ValueError):
        bench.phase_bounds(
            bench.build_parser().parse_args(["--phase-s", "8,8", "--traces-dir", "t"])
        )


def test_keep_store_given_a_folder_is_refused_before_the_run(
    bench: ModuleType, tmp_path: Path
) -> None:
    # the store is copied after the run: a path that cannot take it must fail before it starts
    with pytest.raises(SystemExit) as exc:
        bench.main(
            ["--quick", "--traces-dir", str(tmp_path), "--out-dir", str(tmp_path / "o"),
             "--keep-store", str(tmp_path)]
        )  # fmt: skip
    assert exc.value.code == 2
    assert not list((tmp_path / "o").glob("*.json"))  # nothing ran


def test_replay_is_seeded_and_phased(bench: ModuleType, traces: Path) -> None:
    args = bench.build_parser().parse_args(
        ["--phase-s", "20,35,35,20", "--traces-dir", str(traces)]
    )
    a, info = bench.build_replay(args, 1)
    b, _ = bench.build_replay(args, 1)
    assert [(s.traffic_class, s.offset_s, s.max_tokens) for s in a] == [
        (s.traffic_class, s.offset_s, s.max_tokens) for s in b
    ]
    assert [s.index for s in a] == list(range(len(a)))
    rag = [s.offset_s for s in a if s.traffic_class == "rag"]
    vlm = [s.offset_s for s in a if s.traffic_class == "vlm"]
    assert rag and all(20.0 <= t < 55.0 for t in rag)
    # however bursty the ServeGen window (seed 1's cv is 12), the phase holds rate x length
    assert len(vlm) == round(args.image_rate * 35) and all(55.0 <= t < 90.0 for t in vlm)
    assert info["num_requests"]["vlm"] == len(vlm)


def test_no_images_at_image_rate_zero_and_vllm_refuses_them(
    bench: ModuleType, traces: Path
) -> None:
    # vLLM's Llama folder here has no vision tower: its run has no images, the chat and RAG
    # requests are those of the same seed with images
    base = ["--phase-s", "20,35,35,20", "--traces-dir", str(traces)]
    with_images, _ = bench.build_replay(bench.build_parser().parse_args(base), 2)
    args = bench.build_parser().parse_args([*base, "--image-rate", "0", "--engine", "vllm"])
    none, info = bench.build_replay(args, 2)
    assert info["num_requests"]["vlm"] == 0
    assert [(s.traffic_class, s.offset_s) for s in none] == [
        (s.traffic_class, s.offset_s) for s in with_images if s.traffic_class != "vlm"
    ]
    with pytest.raises(SystemExit) as exc:
        bench.main(["--engine", "vllm", "--traces-dir", str(traces), "--out-dir", "/nonexistent"])
    assert exc.value.code == 2  # refused before anything starts


def test_load_scale_multiplies_every_rate(bench: ModuleType, traces: Path) -> None:
    base = ["--phase-s", "20,35,35,20", "--traces-dir", str(traces)]
    one, _ = bench.build_replay(bench.build_parser().parse_args(base), 0)
    args = bench.build_parser().parse_args([*base, "--load-scale", "3"])
    three, info = bench.build_replay(args, 0)

    def count(specs: list, cls: str) -> int:
        return sum(s.traffic_class == cls for s in specs)

    assert count(three, "vlm") == round(args.image_rate * 3 * 35)
    assert count(three, "chat") > 2 * count(one, "chat")
    assert count(three, "rag") > count(one, "rag")
    assert info["num_requests"]["chat"] == count(three, "chat")
    with pytest.raises(ValueError, match="load-scale"):
        bench.build_replay(bench.build_parser().parse_args([*base, "--load-scale", "0"]), 0)


def _rec(i: int, cls: str, sent: float, ttft: float, gaps: list[float]) -> RequestRecord:
    r = RequestRecord(i, cls, sent, 10, 100)
    r.status, r.ttft_s, r.itl_s = "ok", ttft, gaps
    return r


def test_figures_per_phase_and_summary(bench: ModuleType) -> None:
    args = bench.build_parser().parse_args(
        ["--phase-s", "10", "--ap-lookback", "4", "--traces-dir", "t"]
    )
    slo = AutopilotSlo(100.0, 1000.0, None, {"rag": 5000.0})
    recs = [
        _rec(0, "chat", 1.0, 0.2, [0.05, 0.05]),  # quiet, meets
        _rec(1, "rag", 12.0, 3.0, [0.05]),  # rag, meets its class's TTFT
        _rec(2, "chat", 13.0, 0.2, [0.05, 0.5]),  # rag phase, a stall: misses
        _rec(3, "vlm", 25.0, 2.0, [0.05]),  # image, TTFT above 1 s: misses
    ]
    t0 = 1000.0
    tick = {
        "kind": "hold", "budget": 256, "cap": 0, "previous_budget": 256, "previous_cap": 0,
        "reason": "", "chosen": {"itl_p99_ms": 400.0, "ttft_p99_ms": 2000.0},
        "left": {"itl_p99_ms": 400.0, "ttft_p99_ms": 2000.0},
        "observed": {"itl_p99_ms": None, "ttft_p99_ms": None},
    }  # fmt: skip
    ds = [
        {**tick, "time": t0 + 11.0},  # in the rag phase but its look-back is not: left out
        {**tick, "time": t0 + 15.0},
        {**tick, "time": t0 + 16.0, "kind": "change", "budget": 1024, "reason": "moved"},
    ]
    served = {"arm": "autopilot", "autopilot": True, "budget": 2048, "cap": 0,
              "start_wall": t0, "loadavg_1m": [0.0, 0.0], "records": recs, "decisions": ds,
              "autopilot_exit": 0, "autopilot_tail": "",
              "steps": {"decode_only_ms_p50": 9.0}}  # fmt: skip
    ds[1]["tick_cpu_s"], ds[2]["tick_cpu_s"] = 0.5, 0.25
    fig = bench.arm_figures(args, served, slo)
    assert fig["num_meet"] == 2 and fig["goodput_rps"] == pytest.approx(2 / 40)
    assert [fig["phases"][p]["num_meet"] for p in bench.PHASES] == [1, 1, 0, 0]
    ap = fig["autopilot"]
    rag = ap["phases"]["rag"]
    assert rag["ticks_with_prediction"] == 2 and rag["predicted_chat_itl_p99_ms"] == 400.0
    assert ap["num_changes"] == 1 and ap["changes"][0]["to"] == "1024/0"
    assert [(t["t_s"], t["kind"], t["to"]) for t in ap["tick_log"]] == [
        (11.0, "hold", "256/0"), (15.0, "hold", "256/0"), (16.0, "change", "1024/0"),
    ]  # fmt: skip
    assert ap["cpu_s"] == pytest.approx(0.75) and ap["tick_log"][1]["cpu_s"] == 0.5
    steps = {"decode_only_ms_p50": 6.0}
    static = {**fig, "arm": "2048/0", "autopilot": False, "goodput_rps": 0.04, "steps": steps}
    best = {**fig, "arm": "256/0", "autopilot": False, "goodput_rps": 0.05, "steps": steps}
    [row] = bench.summary([{"seed": 0, "arms": [static, fig, best]}])["per_seed"]
    assert row["best_static"] == "256/0" and row["vs_2048_no_cap"] == pytest.approx(1.25)
    assert row["meets_targets"]
    # meeting all 4 requests where 2048/off met 2 would be 2x: the most any policy could reach
    assert row["ceiling_vs_2048_no_cap"] == pytest.approx(2.0)
    # the steered arm's decode-only steps cost 1.5x the static arms': its own CPU, not its pick
    assert row["decode_step_vs_static"] == pytest.approx(1.5)
    table = bench.markdown([{"seed": 0, "arms": [static, fig, best]}], [row])
    assert "| 0 | rag | 1 / 1 (2048/0) of 2 |" in table and "0.050 **best**" in table


def test_step_costs_are_read_per_arm_from_the_store(bench: ModuleType, tmp_path: Path) -> None:
    # two arms' steps in one store: each arm reads only the steps after its start
    from advisor.simulate import EngineShape, SimRequest, cost_model_step_ns, simulate
    from engine.core.cost_model import CostModel
    from tests.advisor.helpers import store_run

    url = f"sqlite:///{tmp_path / 'store.db'}"
    shape = EngineShape(num_kv_blocks=2000, block_size=16, max_num_seqs=64, max_token_budget=4096)
    reqs = [SimRequest(f"r{i}", i * 10**8, tuple(range(i * 1000, i * 1000 + 300)), 8, "chat")
            for i in range(4)]  # fmt: skip
    cost = CostModel(const=2e-3, prefill=1e-3, decode=1e-3, attn=0.0)
    res = simulate(
        reqs, shape, token_budget=256, step_ns=cost_model_step_ns(cost.predict), gap_ns=0,
        record_steps=True,
    )  # fmt: skip
    store_run(url, reqs, res, shape)
    assert bench.last_step_row(url) == len(res.steps)
    got = bench.step_costs(url, 0)
    assert got["num_steps"] == len(res.steps)
    # 2 ms a step and 1 ms a token: decode-only steps of 4, 4, 4, 4, 3, 2 and 1 decodes, and
    # four full steps of 256 tokens (the fifth, 182 tokens, is not full)
    assert got["num_decode_only"] == 7 and got["decode_only_ms_p50"] == pytest.approx(6.0)
    assert got["num_full"] == {"256/0": 4} and got["full_ms_p50"]["256/0"] == pytest.approx(258)
    assert bench.step_costs(url, bench.last_step_row(url))["num_steps"] == 0
