"""The advisor's store side on known data: a run simulated with a known cost model and a known
pause between steps is written into a store as telemetry; the fit recovers the coefficients, the
traffic reads back as it was sent, and predicting from the store at the run's own budget gives
the run's own figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from advisor import cli
from advisor.fit import (
    BOOT_RESAMPLES,
    FitError,
    FitReport,
    carry_spread,
    fit_from_store,
    step_works,
)
from advisor.predict import predict_from_store
from advisor.recommend import Slo
from advisor.simulate import EngineShape, cost_model_step_ns, figures, simulate
from advisor.traffic import engine_shape, observed_traffic, to_sim_requests
from engine.core.cost_model import CostModel, StepWork
from storage import db as dbm
from tests.advisor.helpers import random_requests, store_run

TRUE = CostModel(const=2e-3, prefill=50e-6, decode=300e-6, attn=2e-9)
GAP_NS = 400_000
SHAPE = EngineShape(num_kv_blocks=400, block_size=16, max_num_seqs=64, max_token_budget=4096)
BUDGET = 96


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict:
    reqs = random_requests(3, 60)
    result = simulate(
        reqs,
        SHAPE,
        token_budget=BUDGET,
        step_ns=cost_model_step_ns(TRUE.predict),
        gap_ns=GAP_NS,
        record_steps=True,
    )
    assert result.unfinished == 0 and result.num_steps > 100
    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}"
    wall_ns = store_run(url, reqs, result, SHAPE)
    return {"url": url, "reqs": reqs, "result": result, "wall_ns": wall_ns}


def test_step_works_count_as_from_chunks() -> None:
    import pandas as pd

    chunks = pd.DataFrame(
        {
            "engine_id": ["e"] * 4,
            "run_id": ["r"] * 4,
            "step": [0, 0, 1, 1],
            "kind": ["prefill", "decode", "prefill", "prefill"],
            "start": [0, 40, 64, 0],
            "num_tokens": [64, 1, 30, 7],
        }
    )
    got = step_works(chunks)
    for step in (0, 1):
        rows = chunks[chunks["step"] == step].to_dict("records")
        want = StepWork.from_chunks(rows)
        row = got[got["step"] == step].iloc[0]
        assert (row["prefill_tokens"], row["decode_tokens"], row["attention_pairs"]) == (
            want.prefill_tokens,
            want.decode_tokens,
            want.attention_pairs,
        )


def test_fit_recovers_known_coefficients(recorded: dict) -> None:
    db = dbm.connect(recorded["url"], readonly=True)
    try:
        report = fit_from_store(db)
    finally:
        db.dispose()
    m = report.model
    assert report.num_steps == recorded["result"].num_steps
    for got, want in ((m.const, TRUE.const), (m.prefill, TRUE.prefill), (m.decode, TRUE.decode)):
        assert got == pytest.approx(want, rel=1e-3)
    assert m.attn == pytest.approx(TRUE.attn, rel=1e-2)
    assert m.r2 > 0.9999 and m.rel_err_p95 < 1e-3
    assert report.step_gap_s == pytest.approx(GAP_NS / 1e9, abs=1e-9)
    assert report.quality["poor"] is False, report.quality["reasons"]  # an exact fit is not poor
    assert report.quality["by_shape"]["decode"]["ratio_p50"] == pytest.approx(1.0, rel=1e-3)
    # exact steps: every resample fits the same costs, so the prefill cost is pinned down
    assert len(report.boot) == BOOT_RESAMPLES
    assert carry_spread(report.boot, [(500, 0), (40, 0)], 32) == pytest.approx(0.0, abs=1e-3)
    # the largest step it was fitted on: beyond it a prediction is an extrapolation
    works = [StepWork.from_chunks(s.chunks) for s in recorded["result"].steps]
    assert report.seen == {
        "prefill_tokens": max(w.prefill_tokens for w in works),
        "attention_pairs": max(w.attention_pairs for w in works),
    }
    assert report.seen["prefill_tokens"] <= BUDGET
    assert FitReport.from_dict(report.to_dict()).seen == report.seen


def test_fit_refuses_an_empty_selection(recorded: dict) -> None:
    db = dbm.connect(recorded["url"], readonly=True)
    try:
        with pytest.raises(FitError):
            fit_from_store(db, engine_id="no-such-engine")
    finally:
        db.dispose()


def test_traffic_and_shape_read_back(recorded: dict) -> None:
    db = dbm.connect(recorded["url"], readonly=True)
    try:
        traffic = observed_traffic(db)
        shape = engine_shape(db)
    finally:
        db.dispose()
    reqs = recorded["reqs"]
    assert [r.request_id for r in traffic.requests] == [r.request_id for r in reqs]
    assert [r.num_prompt_tokens for r in traffic.requests] == [
        len(r.prompt_token_ids) for r in reqs
    ]
    assert [r.num_output_tokens for r in traffic.requests] == [r.num_output_tokens for r in reqs]
    assert [r.traffic_class for r in traffic.requests] == [r.traffic_class for r in reqs]
    t0 = traffic.requests[0].arrival
    for got, want in zip(traffic.requests, reqs, strict=True):
        assert (got.arrival - t0) * 1e9 == pytest.approx(
            want.arrival_ns - reqs[0].arrival_ns, abs=2e3
        )
    assert shape == SHAPE.__class__(
        num_kv_blocks=SHAPE.num_kv_blocks,
        block_size=SHAPE.block_size,
        max_num_seqs=SHAPE.max_num_seqs,
        max_token_budget=SHAPE.max_token_budget,
    )
    summary = traffic.summary()
    assert summary["classes"]["all"]["num_requests"] == len(reqs)
    assert set(summary["classes"]) == {"all", "chat", "rag"}


def test_shared_prefixes_follow_the_observed_cache_hits() -> None:
    from advisor.traffic import ObservedRequest, Traffic

    def obs(i: int, cls: str, prompt: int, cached: int) -> ObservedRequest:
        return ObservedRequest(f"r{i}", cls, float(i), prompt, 0, cached, 5)

    traffic = Traffic(
        [
            obs(0, "rag", 100, 64),  # its document was cached before the window
            obs(1, "rag", 90, 64),  # same document as r0
            obs(2, "chat", 40, 0),
            obs(3, "chat", 50, 32),  # the system prompt of r2
            obs(4, "rag", 300, 0),
            obs(5, "rag", 310, 256),  # the document of r4
        ],
        0.0,
        5.0,
    )
    sims, warm = to_sim_requests(traffic, block_size=16)
    p = [s.prompt_token_ids for s in sims]
    assert warm == [p[0][:64]]
    assert p[1][:64] == p[0][:64] and p[1][64] != p[0][64]
    assert p[3][:32] == p[2][:32] and p[3][32] != p[2][32]
    assert p[5][:256] == p[4][:256]
    assert not set(p[2]) & set(p[0])
    # replayed, the cache gives the observed hits
    shape = EngineShape(num_kv_blocks=1000, block_size=16)
    res = simulate(
        sims, shape, token_budget=4096, step_ns=lambda plan: 1000, warm_prefixes=warm,
        record_steps=True,
    )  # fmt: skip
    first = {}
    for s in res.steps:
        for c in s.chunks:
            first.setdefault(c.request_id, c.start)
    assert first == {"r0": 64, "r1": 64, "r2": 0, "r3": 32, "r4": 0, "r5": 256}


def test_prediction_at_the_recorded_budget_gives_the_recorded_figures(recorded: dict) -> None:
    doc = predict_from_store(recorded["url"], [32, BUDGET, 1024], slo=Slo(itl_ms=50.0))
    by_budget = {w["budget"]: w for w in doc["windows"]}
    want = figures(recorded["result"])
    got = by_budget[BUDGET]
    for key in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "ttft_p50_ms", "ttft_p99_ms"):
        assert got[key] == pytest.approx(want[key], rel=1e-3), key
    assert got["output_tokens"] == want["output_tokens"]
    # and at another budget: the same as simulating with the true model
    reqs = recorded["reqs"]
    direct = simulate(
        reqs, SHAPE, token_budget=32, step_ns=cost_model_step_ns(TRUE.predict), gap_ns=GAP_NS
    )
    assert by_budget[32]["itl_p99_ms"] == pytest.approx(figures(direct)["itl_p99_ms"], rel=1e-3)
    assert by_budget[32]["ttft_p99_ms"] == pytest.approx(figures(direct)["ttft_p99_ms"], rel=1e-3)
    assert doc["recommendation_source"] == "predicted"
    assert doc["fit"]["num_steps"] == recorded["result"].num_steps


def test_cli_predict_writes_the_document(recorded: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "pred.json"
    rc = cli.main(
        [
            "predict",
            "--db",
            recorded["url"],
            "--engine",
            "engine-sim",
            "--budgets",
            "32,96,1024",
            "--slo-itl-ms",
            "1000",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [w["budget"] for w in doc["windows"]] == [32, 96, 1024]
    # the recorded traffic is a 1 s burst of 60 requests: a third still wait for a first token
    # at its end, so the window is overloaded and nothing is recommended from it
    assert doc["observed_window"]["overloaded"] and doc["recommended_budget"] is None
    assert doc["recommendation_source"] == "predicted" and "observed window was" in doc["reason"]
    assert doc["slo"]["itl_p99_ms"] == 1000 and doc["slo"]["itl_max_ms"] is None
    text = capsys.readouterr().out
    assert "cost model" in text and "Pareto front" in text
    assert "prefill cost on resampled steps: p10-p90 spread 0% at 32" in text
    assert "observed window overloaded: its queue grew" in text


def test_cli_predict_on_an_empty_store_exits_1(tmp_path: Path, capsys) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    db = dbm.connect(url)
    dbm.migrate(db)
    db.dispose()
    assert cli.main(["predict", "--db", url]) == 1
    assert "advisor:" in capsys.readouterr().err


def test_advisor_never_imports_torch() -> None:
    code = (
        "import sys, advisor, advisor.fit, advisor.traffic, advisor.simulate, "
        "advisor.recommend, advisor.pareto, advisor.predict, advisor.cli; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch']; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
