"""Whether the fit window's steps pin the prefill cost down (issue 19d): fits on resamples of
the steps (``FitReport.boot``) and their spread on the traffic's prefill at each budget; a
spread above the error target makes no recommendation."""

from __future__ import annotations

import numpy as np
import pytest

from advisor.fit import (
    BOOT_RESAMPLES,
    CARRY_SPREAD,
    FitReport,
    bootstrap_coefs,
    carry_spread,
    prefill_work,
)
from advisor.predict import predict_traffic
from advisor.recommend import Slo
from advisor.simulate import EngineShape
from advisor.traffic import ObservedRequest, Traffic
from engine.core.cost_model import FEATURES, CostModel, StepWork, chunk_pairs

MODEL = CostModel(const=0.007, prefill=3e-4, decode=5e-4, attn=6e-8, attn_decode=1.5e-6)
PROMPTS = [(2500, 0), (60, 32), (3000, 0)]


def test_prefill_work_counts_the_chunks_of_each_prompt() -> None:
    # 1000 tokens in chunks of 512; 300 with 256 cached: one chunk of 44 after them; a prompt
    # whose every token is cached still computes its last one
    got = prefill_work([(1000, 0), (300, 256), (64, 64)], 512)
    pairs = chunk_pairs(0, 512) + chunk_pairs(512, 488) + chunk_pairs(256, 44) + chunk_pairs(63, 1)
    assert got == (4, 1000 + 44 + 1, pairs)
    assert prefill_work([(1000, 0)], 4096) == (1, 1000, chunk_pairs(0, 1000))
    with pytest.raises(ValueError, match="budget"):
        prefill_work([(10, 0)], 0)


def _window(n_prefill: int, disturbed: float, seed: int = 0) -> tuple[list[StepWork], np.ndarray]:
    """300 decode-only steps of 1-8 sequences and ``n_prefill`` 1024-token chunks at contexts
    0-3072, measured as the model says times a 3% scatter; the first prefill step slowed by
    ``disturbed`` (something else ran on the machine)."""
    rng = np.random.default_rng(seed)
    works = []
    for _ in range(300):
        d = int(rng.integers(1, 9))
        ctx = int(rng.integers(100, 3000))
        works.append(StepWork(0, d, d * ctx, d * ctx))
    for i in range(n_prefill):
        start = 1024 * (i % 4)
        works.append(StepWork(1024, 1, chunk_pairs(start, 1024) + 500, 500))
    t = MODEL.predict_many(works) * rng.normal(1.0, 0.03, len(works))
    t[300] *= disturbed
    return works, t


def test_many_prefill_steps_pin_the_cost_down() -> None:
    works, t = _window(40, 1.0)
    boot = bootstrap_coefs(works, t)
    assert len(boot) == BOOT_RESAMPLES and all(len(row) == len(FEATURES) for row in boot)
    for b in (128, 512, 4096):
        assert carry_spread(boot, PROMPTS, b) < 0.05


def test_a_few_prefill_steps_one_of_them_slowed_do_not() -> None:
    """Five prefill steps, one of them 1.8x: which of them a resample keeps moves the fitted
    prefill cost by more than the 15% the predictions are held to."""
    works, t = _window(5, 1.8)
    boot = bootstrap_coefs(works, t)
    assert carry_spread(boot, PROMPTS, 512) > CARRY_SPREAD
    # resampling is seeded: the same steps, the same verdict
    assert bootstrap_coefs(works, t) == boot
    assert carry_spread([], PROMPTS, 512) is None and carry_spread(boot, [], 512) is None


def _traffic() -> Traffic:
    reqs = [ObservedRequest(f"c{i}", "chat", 0.5 * i, 64, 0, 0, 20) for i in range(20)]
    return Traffic(reqs, 0.0, 10.0)


def _boot(spread: float) -> list[list[float]]:
    """Resampled fits whose per-token prefill cost runs over +-``spread`` / 2."""
    base = [MODEL.const, MODEL.prefill, MODEL.decode, MODEL.attn, MODEL.attn_decode]
    return [
        [base[0], base[1] * (1 + f), *base[2:]] for f in np.linspace(-spread / 2, spread / 2, 21)
    ]


@pytest.mark.parametrize("spread", [0.02, 0.6])
def test_a_fit_the_steps_do_not_pin_down_recommends_nothing(spread: float) -> None:
    report = FitReport(
        MODEL, 500, 0.0, 0.0, quality={"poor": False, "reasons": []}, boot=_boot(spread)
    )
    assert FitReport.from_dict(report.to_dict()).boot == report.boot
    shape = EngineShape(num_kv_blocks=4096)
    kw = {"slo": Slo(itl_ms=1000.0), "noise": False}
    doc = predict_traffic(report, _traffic(), shape, [128, 512], **kw)
    carry = doc["fit_quality"]["carry"]
    assert set(carry) == {"128", "512"} and len(doc["windows"]) == 2
    if spread > CARRY_SPREAD:
        assert all(v > CARRY_SPREAD for v in carry.values())
        assert doc["fit_quality"]["poor"] and doc["recommended_budget"] is None
        assert "the steps do not pin the prefill cost down" in doc["reason"]
        assert report.quality["poor"] is False  # the report itself is left as it was
        forced = predict_traffic(report, _traffic(), shape, [128, 512], allow_poor_fit=True, **kw)
        assert forced["recommended_budget"] in (128, 512)
    else:
        assert all(v < CARRY_SPREAD for v in carry.values())
        assert not doc["fit_quality"]["poor"] and doc["recommended_budget"] in (128, 512)


def test_a_report_without_resamples_skips_the_check() -> None:
    """A report saved before the resamples existed (or the autopilot's, fitted with none)."""
    d = FitReport(MODEL, 500, 0.0, 0.0, quality={"poor": False, "reasons": []}).to_dict()
    d.pop("boot")
    report = FitReport.from_dict(d)
    doc = predict_traffic(report, _traffic(), EngineShape(num_kv_blocks=4096), [128], slo=Slo())
    assert doc["fit_quality"]["carry"] == {"128": None} and not doc["fit_quality"]["poor"]
