"""The measured scatter of step times, kept by the fit and replayed by the simulator."""

from __future__ import annotations

import random

import numpy as np
import pandas as pd

from advisor.fit import FitReport, noise_model, recent_noise, with_recent_noise
from advisor.predict import step_timing
from advisor.simulate import drawn_gap_ns, noisy_step_ns
from engine.core.cost_model import CostModel, StepWork
from engine.core.scheduler import StepPlan


def test_scatter_is_kept_per_predicted_duration() -> None:
    # small steps (1-10 ms) took 1x or 3x their prediction; large ones (100-200 ms) exactly it
    small = np.linspace(1e-3, 10e-3, 200)
    large = np.linspace(100e-3, 200e-3, 200)
    pred = np.concatenate([small, large])
    ratio = np.concatenate([np.where(np.arange(200) % 2 == 0, 1.0, 3.0), np.ones(200)])
    noise = noise_model(pred, pred * ratio, np.full(50, 2e-4))
    assert len(noise.edges_s) == 8 and noise.edges_s == sorted(noise.edges_s)
    small_bins = [r for e, r in zip(noise.edges_s, noise.ratios, strict=True) if e <= 10e-3]
    large_bins = [r for e, r in zip(noise.edges_s, noise.ratios, strict=True) if e >= 100e-3]
    assert small_bins and large_bins
    assert all(set(np.round(r, 6)) <= {1.0, 3.0} and round(max(r), 6) == 3.0 for r in small_bins)
    assert all(set(np.round(r, 6)) == {1.0} for r in large_bins)
    assert set(noise.gaps_s) == {2e-4}

    model = CostModel(const=0.0, prefill=1e-3, decode=1e-3, attn=0.0)
    step = noisy_step_ns(model.predict, noise.edges_s, noise.ratios, random.Random(0))

    def plan(n: int) -> StepPlan:
        p = StepPlan(0, 4096, "chunked")

        class C:  # a chunk as StepWork.from_chunks reads it
            kind, start, num_tokens = "prefill", 0, n

        p.chunks = [C()]  # type: ignore[list-item]
        return p

    small_draws = {step(plan(5)) for _ in range(200)}  # 5 ms predicted
    assert small_draws == {5_000_000, 15_000_000}
    assert {step(plan(150)) for _ in range(50)} == {150_000_000}
    # beyond the largest bin: that bin's scatter
    assert {step(plan(900)) for _ in range(20)} == {900_000_000}
    gap = drawn_gap_ns(noise.gaps_s, random.Random(0))
    assert gap() == 200_000


def test_report_round_trips_with_its_noise() -> None:
    pred = np.linspace(1e-3, 5e-3, 100)
    report = FitReport(
        model=CostModel(1e-3, 2e-6, 3e-6, 4e-10, num_steps=100),
        num_steps=100,
        step_gap_s=1e-4,
        step_gap_p90_s=2e-4,
        noise=noise_model(pred, pred * 1.5, np.array([1e-4, 2e-4])),
    )
    back = FitReport.from_dict(report.to_dict())
    assert back == report
    assert back.step_seconds(StepWork(10, 0, 0)) == report.model.predict(StepWork(10, 0, 0))
    # the timing functions: scatter and drawn pauses, or the bare prediction and the median
    step, gap = step_timing(back, seed=1)
    assert callable(gap)
    step, gap = step_timing(back, noise=False)
    assert gap == 100_000
    step, gap = step_timing(back, step_gap=False)
    assert gap == 0


def test_robust_fit_leaves_out_stretched_steps() -> None:
    from advisor.fit import robust_fit

    true = CostModel(const=2e-3, prefill=50e-6, decode=300e-6, attn=2e-9)
    rng = random.Random(5)
    works = []
    for _ in range(2000):
        n = rng.randint(0, 512)
        d = rng.randint(0, 32)
        s = rng.randint(0, 3000)
        works.append(StepWork(n, d, n * s + n * (n + 1) // 2 + d * s))
    measured = np.array([true.predict(w) * rng.uniform(0.95, 1.05) for w in works])
    stretched = np.array([rng.random() < 0.05 for _ in works])
    measured[stretched] *= 10.0  # another process took the cores for these steps
    model, inliers = robust_fit(works, measured)
    assert not inliers[stretched].any() and inliers[~stretched].mean() > 0.99
    # the constant of a step of several rows (nearly every step here: a lone decode or an empty
    # step is one in a few hundred, too few to split const from multi_row)
    const = model.const + model.multi_row
    for got, want in ((const, true.const), (model.prefill, true.prefill)):
        assert abs(got - want) / want < 0.05
    assert abs(model.decode - true.decode) / true.decode < 0.05
    assert abs(model.attn - true.attn) / true.attn < 0.05
    plain = fit_plain(works, measured)
    # what least squares alone does
    assert abs(plain.prefill - true.prefill) / true.prefill > 0.2


def fit_plain(works: list[StepWork], measured: np.ndarray) -> CostModel:
    from engine.core.cost_model import fit

    return fit(works, measured.tolist())


def test_relative_fit_recovers_coefficients() -> None:
    from advisor.fit import relative_fit, robust_fit

    true = CostModel(const=2e-3, prefill=50e-6, decode=300e-6, attn=2e-9)
    rng = random.Random(9)
    works = []
    for _ in range(1500):
        n = rng.choice([0, 0, 0, rng.randint(1, 2048)])
        d = rng.randint(1, 16)
        works.append(StepWork(n, d, n * (n + 1) // 2 + n * rng.randint(0, 2000)))
    exact = np.array([true.predict(w) for w in works])
    model = relative_fit(works, exact)
    for got, want in zip(
        (model.const, model.prefill, model.decode, model.attn),
        (true.const, true.prefill, true.decode, true.attn),
        strict=True,
    ):
        assert abs(got - want) / want < 1e-6
    noisy = exact * np.array([rng.uniform(0.9, 1.1) for _ in works])
    rel, _ = robust_fit(works, noisy, "relative")
    ols, _ = robust_fit(works, noisy, "ols")
    short = [i for i, w in enumerate(works) if w.prefill_tokens == 0]
    err = {
        name: float(np.median([abs(m.predict(works[i]) - exact[i]) / exact[i] for i in short]))
        for name, m in (("relative", rel), ("ols", ols))
    }
    assert err["relative"] < 0.02 and err["ols"] < 0.02


def _decode_steps(n: int, took_s: float, pause_s: float) -> pd.DataFrame:
    """``n`` consecutive steps of one decode token each (as ``load_steps`` gives them), each
    taking ``took_s`` with ``pause_s`` after it, the engine busy throughout."""
    start = (np.arange(n) * (took_s + pause_s) * 1e9).astype(np.int64)
    return pd.DataFrame(
        {
            "engine_id": "e",
            "run_id": "r",
            "step": np.arange(n),
            "start_ns": start,
            "end_ns": start + int(took_s * 1e9),
            "num_scheduled_tokens": 1,
            "prefill_tokens": 0,
            "decode_tokens": 1,
            "attention_pairs": 0,
            "num_running": 1,
            "num_waiting": 0,
        }  # fmt: skip
    )


def test_recent_scatter_replaces_the_fit_windows_for_the_steps_it_covers() -> None:
    # the fit window: 5 ms decode steps and 200 ms chunks, both exactly as predicted, 0.1 ms
    # pauses; in the last seconds the machine slowed: decode steps took 2x, pauses 1 ms
    pred = np.concatenate([np.full(100, 5e-3), np.full(100, 200e-3)])
    report = FitReport(
        model=CostModel(const=0.0, prefill=0.0, decode=5e-3, attn=0.0),
        num_steps=200,
        step_gap_s=1e-4,
        step_gap_p90_s=1e-4,
        noise=noise_model(pred, pred, np.full(100, 1e-4), binning="duration"),
    )
    recent = _decode_steps(60, took_s=10e-3, pause_s=1e-3)
    noise = recent_noise(report, recent)
    assert noise is not None
    short = [r for e, r in zip(noise.edges_s, noise.ratios, strict=True) if e < 0.1]
    assert short and all(set(np.round(r, 6)) == {2.0} for r in short)
    # longer steps than any recent one keep the fit window's scatter
    assert noise.edges_s[-1] == 200e-3 and set(np.round(noise.ratios[-1], 6)) == {1.0}
    assert set(np.round(noise.gaps_s, 6)) == {1e-3}
    step = noisy_step_ns(report.model.predict, noise.edges_s, noise.ratios, random.Random(0))
    plan = StepPlan(0, 256, "chunked")

    class C:  # one decode token
        kind, start, num_tokens = "decode", 0, 1

    plan.chunks = [C()]  # type: ignore[list-item]
    assert step(plan) == 10_000_000
    with_it, n = with_recent_noise(report, recent)
    assert n == 60 and with_it.noise == noise and with_it.model == report.model


def test_too_few_recent_steps_keep_the_fit_windows_scatter() -> None:
    pred = np.full(100, 5e-3)
    report = FitReport(
        model=CostModel(const=0.0, prefill=0.0, decode=5e-3, attn=0.0),
        num_steps=100,
        step_gap_s=1e-4,
        step_gap_p90_s=1e-4,
        noise=noise_model(pred, pred, np.full(10, 1e-4)),
    )
    few = _decode_steps(49, took_s=10e-3, pause_s=1e-3)
    assert recent_noise(report, few) is None
    assert with_recent_noise(report, few) == (report, 0)
