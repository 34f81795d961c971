"""A fit that cannot carry a prediction is reported as poor, with the reason, and makes no
recommendation (issue 19: "a decision the model cannot support is not made")."""

from __future__ import annotations

import numpy as np
import pytest

from advisor.fit import FitReport, NoiseModel, fit_quality
from advisor.predict import predict_traffic
from advisor.recommend import Slo
from advisor.simulate import EngineShape
from advisor.traffic import ObservedRequest, Traffic
from engine.core.cost_model import CostModel, StepWork

MODEL = CostModel(const=0.004, prefill=3e-4, decode=1e-3, attn=2e-8)


def steps(seed: int = 0, n_decode: int = 300, n_prefill: int = 40) -> dict[str, np.ndarray]:
    """Decode-only steps of 1-12 sequences and prefill chunks of 16-1024 tokens at contexts
    up to 3000, one every 20 ms, measured as the model says times a 5% scatter."""
    rng = np.random.default_rng(seed)
    dec = np.r_[rng.integers(1, 13, n_decode), rng.integers(0, 6, n_prefill)]
    pre = np.r_[np.zeros(n_decode, dtype=np.int64), rng.integers(16, 1025, n_prefill)]
    ctx = np.r_[np.zeros(n_decode, dtype=np.int64), rng.integers(0, 3000, n_prefill)]
    pairs = pre * ctx + pre * (pre + 1) // 2 + dec * 200
    order = rng.permutation(len(dec))
    dec, pre, pairs = dec[order], pre[order], pairs[order]
    pred = MODEL.predict_many(
        [StepWork(int(p), int(d), int(a)) for p, d, a in zip(pre, dec, pairs, strict=True)]
    )
    return {
        "prefill": pre,
        "decode": dec,
        "pairs": pairs,
        "predicted": pred,
        "measured": pred * rng.normal(1.0, 0.05, len(pred)),
        "image_prefill": np.zeros(len(pre), dtype=np.int64),
        "start_ns": np.arange(len(pre), dtype=np.int64) * 20_000_000,
    }


def quality(s: dict[str, np.ndarray], model: CostModel = MODEL) -> dict:
    return fit_quality(
        model,
        s["measured"],
        s["predicted"],
        prefill=s["prefill"],
        decode=s["decode"],
        image_prefill=s["image_prefill"],
        start_ns=s["start_ns"],
    )


def test_a_good_fit_is_not_poor() -> None:
    q = quality(steps())
    assert q["poor"] is False and q["reasons"] == []
    assert set(q["by_shape"]) == {"decode", "prefill"}
    assert q["by_shape"]["decode"]["ratio_p50"] == pytest.approx(1.0, abs=0.03)
    assert q["cheapest_ms"] == pytest.approx(5.0, rel=0.1)  # decode of 1: 4 ms + 1 ms


def test_a_constant_above_the_cheapest_steps_is_poor() -> None:
    """The 82 ms constant of a loaded machine: no step can cost less than the constant."""
    s = steps()
    loaded = CostModel(const=0.082, prefill=3e-4, decode=1e-3, attn=2e-8)
    q = quality(s, loaded)
    assert q["poor"] and any("per-step constant 82.0 ms" in r for r in q["reasons"])


def test_a_shape_the_model_misses_is_poor() -> None:
    """Prefill of requests with images took twice the prediction: the vision encoder."""
    s = steps()
    pre = np.flatnonzero(s["prefill"] > 0)[:10]
    s["image_prefill"][pre] = s["prefill"][pre]
    s["measured"][pre] *= 2.0
    q = quality(s)
    assert q["by_shape"]["vision prefill"]["num_steps"] == 10
    assert q["poor"] and any(r.startswith("vision prefill steps took 2.") for r in q["reasons"])


def test_the_machine_changing_speed_is_poor() -> None:
    s = steps()
    late = s["start_ns"] >= s["start_ns"][len(s["start_ns"]) * 2 // 3]
    s["measured"][late] *= 2.0
    q = quality(s)
    assert len(q["drift"]) == 3 and q["drift"][2] / q["drift"][0] > 1.8
    assert q["poor"] and any("speed changed" in r for r in q["reasons"])


def test_too_few_prefill_steps_is_poor() -> None:
    q = quality(steps(n_prefill=5))
    assert q["num_prefill_steps"] == 5
    assert q["poor"] and any("only 5 steps with prefill" in r for r in q["reasons"])


def _traffic() -> Traffic:
    reqs = [ObservedRequest(f"c{i}", "chat", 0.5 * i, 64, 0, 0, 20) for i in range(20)]
    return Traffic(reqs, 0.0, 10.0)


@pytest.mark.parametrize("poor", [False, True])
def test_a_poor_fit_makes_no_recommendation(poor: bool) -> None:
    q = {"poor": poor, "reasons": ["relative error p50 40% (over 25%)"] if poor else []}
    report = FitReport(MODEL, 500, 0.0, 0.0, quality=q)
    shape = EngineShape(num_kv_blocks=4096)
    kw = {"slo": Slo(itl_ms=1000.0), "noise": False}
    doc = predict_traffic(report, _traffic(), shape, [128, 512], **kw)
    # the figures are still given; no resampled fits in this report: no carry verdict
    assert {k: v for k, v in doc["fit_quality"].items() if k != "carry"} == q
    assert doc["fit_quality"]["carry"] == {"128": None, "512": None}
    assert len(doc["windows"]) == 2
    if poor:
        assert doc["recommended_budget"] is None
        assert "poor fit of the step-cost model (relative error p50 40%" in doc["reason"]
        forced = predict_traffic(report, _traffic(), shape, [128, 512], allow_poor_fit=True, **kw)
        assert forced["recommended_budget"] in (128, 512)
    else:
        assert doc["recommended_budget"] in (128, 512)
    assert FitReport.from_dict(report.to_dict()).poor is poor


def test_draws_give_each_figure_its_median() -> None:
    """``draws`` > 1: the median over draws of the scatter, per figure and budget; one draw is
    the plain prediction. A planted mean (or the first draw) fails the median check."""
    from advisor.predict import median_windows

    runs = [
        [{"budget": 128, "cap": 0, "itl_p99_ms": v, "itl_max_ms": None, "overloaded": o}]
        for v, o in ((10.0, False), (30.0, True), (11.0, False))
    ]
    got = median_windows(runs)[0]
    assert got["itl_p99_ms"] == 11.0 and got["budget"] == 128 and got["cap"] == 0
    assert got["itl_max_ms"] is None and got["overloaded"] is False
    # the draws' lowest and highest beside the median: a wide one is a knife-edge tail
    assert got["draw_range"] == {"itl_p99_ms": [10.0, 30.0]}
    from advisor.text import budget_table

    table = budget_table([got], ("budget", "itl_p99_ms", "itl_max_ms"), [128])
    assert table[1].split() == ["128", "11.0", "(10-30)", "-"]
    runs[2][0]["overloaded"] = True
    runs[2][0]["overload_reason"] = "queue grew"
    assert median_windows(runs)[0]["overloaded"] is True  # most draws say so
    noise = NoiseModel([1.0], [[0.5, 1.0, 2.0]], [0.0])
    report = FitReport(MODEL, 500, 0.0, 0.0, noise=noise)
    shape = EngineShape(num_kv_blocks=4096)
    kw = {"slo": Slo(itl_ms=1000.0), "seed": 3}
    one = [predict_traffic(report, _traffic(), shape, [128], seed=3 + k, slo=kw["slo"])
           for k in range(3)]  # fmt: skip
    three = predict_traffic(report, _traffic(), shape, [128], draws=3, **kw)
    assert three["draws"] == 3
    for key in ("itl_p99_ms", "ttft_p99_ms", "tokens_per_s"):
        vals = sorted(d["windows"][0][key] for d in one)
        assert three["windows"][0][key] == pytest.approx(vals[1]), key
    with pytest.raises(ValueError, match="draws"):
        predict_traffic(report, _traffic(), shape, [128], draws=0, **kw)
