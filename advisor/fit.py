"""Fit the step cost model (``engine.core.cost_model``) to the steps recorded in the store.

Each stored step gives its chunk layout (``storage.queries.step_chunks``) and its duration
(``end_ns - start_ns``, ``storage.queries.steps``); the work of a step is
``StepWork(prefill tokens, decode tokens, attention pairs)`` exactly as ``StepWork.from_chunks``
counts it, and ``engine.core.cost_model.fit`` solves the least squares. The report carries the fit's
own error (relative error p50/p95 and R^2 on the steps it was fitted on) and the engine's pause
between steps while it has work (the time from one step's end to the next step's start: event
emission, the inbox, telemetry), which the simulator adds after every step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from advisor.quantiles import mass_quantiles
from engine.core.cost_model import FEATURES, CostModel, StepWork, chunk_pairs, fit
from storage import queries

logger = logging.getLogger(__name__)


class FitError(ValueError):
    """Too few usable steps in the selection to fit the model."""


NOISE_BINS = 8
NOISE_MIN_STEPS = 40  # per bin
NOISE_QUANTILES = 200  # each bin keeps its ratio distribution as this many quantiles
GAP_QUANTILES = 200


@dataclass(frozen=True)
class NoiseModel:
    """How measured step times scatter around the model's prediction, and how long the pauses
    between steps are: what makes the tail of the inter-token latency (a p99 ITL is a slow step,
    not an average one).

    Steps are binned by predicted duration (``edges_s``: each bin's largest prediction); each bin
    keeps the distribution of measured/predicted as quantiles of equal mass
    (``advisor.quantiles.mass_quantiles``), so drawing one of them uniformly draws from that
    distribution. ``gaps_s`` keeps the busy pauses the same way.
    """

    edges_s: list[float]
    ratios: list[list[float]]
    gaps_s: list[float]


def duration_bins(pred: np.ndarray, factor: float, min_steps: int) -> list[np.ndarray]:
    """Index ranges of ``pred`` (sorted ascending) cut by duration: a bin closes once it holds
    ``min_steps`` steps and the next prediction is over ``factor`` times the bin's first; a
    last bin with fewer than ``min_steps`` joins the one before it. A 300 ms step then draws
    the scatter of steps of its own length, not of the 10-30 ms ones that share an
    equal-count top bin with it (long steps scatter less: issue 19d)."""
    bins: list[list[int]] = []
    cur: list[int] = []
    for i, p in enumerate(pred):
        if cur and len(cur) >= min_steps and p > factor * pred[cur[0]]:
            bins.append(cur)
            cur = []
        cur.append(i)
    if cur:
        if bins and len(cur) < min_steps:
            bins[-1].extend(cur)
        else:
            bins.append(cur)
    return [np.asarray(b, dtype=np.int64) for b in bins]


NOISE_FACTOR = 1.6  # duration bins: each spans at most this factor (once it holds enough steps)
NOISE_MIN_STEPS_DURATION = 20


def noise_model(
    predicted_s: np.ndarray,
    measured_s: np.ndarray,
    gaps_s: np.ndarray,
    *,
    binning: str = "count",
) -> NoiseModel:
    """The scatter of ``measured_s`` around ``predicted_s`` per bin of predicted duration:
    ``binning`` "count" (``NOISE_BINS`` bins of equal count, at least ``NOISE_MIN_STEPS``
    each) or "duration" (:func:`duration_bins`: bins no wider than ``NOISE_FACTOR``)."""
    ok = predicted_s > 0
    pred, meas = predicted_s[ok], measured_s[ok]
    order = np.argsort(pred, kind="stable")
    pred, ratio = pred[order], (meas / pred)[order]
    if binning == "duration":
        idx = duration_bins(pred, NOISE_FACTOR, NOISE_MIN_STEPS_DURATION)
        groups = [(pred[i], ratio[i]) for i in idx]
    elif binning == "count":
        n_bins = max(1, min(NOISE_BINS, len(pred) // NOISE_MIN_STEPS))
        groups = list(zip(np.array_split(pred, n_bins), np.array_split(ratio, n_bins), strict=True))
    else:
        raise ValueError(f"binning must be 'count' or 'duration', got {binning!r}")
    edges: list[float] = []
    ratios: list[list[float]] = []
    for chunk_pred, chunk_ratio in groups:
        if chunk_pred.size == 0:
            continue
        edges.append(float(chunk_pred[-1]))
        ratios.append(mass_quantiles(chunk_ratio, NOISE_QUANTILES))
    return NoiseModel(edges, ratios, mass_quantiles(gaps_s, GAP_QUANTILES))


@dataclass(frozen=True)
class FitReport:
    """A fitted cost model and how well it fits."""

    model: CostModel
    num_steps: int
    step_gap_s: float  # median pause between consecutive steps while the engine is busy
    step_gap_p90_s: float
    selection: dict[str, Any] = field(default_factory=dict)
    noise: NoiseModel | None = None
    num_outliers: int = 0  # steps left out of the least squares (see ``robust_fit``)
    rel_err_p50_all: float = 0.0  # relative error over every step, outliers included
    rel_err_p95_all: float = 0.0
    # whether the fit can carry a prediction (:func:`fit_quality`): {"poor", "reasons", ...}
    quality: dict[str, Any] = field(default_factory=dict)
    # the coefficients (``FEATURES`` order) refitted on resamples of the steps: how well the
    # steps pin each cost down (:func:`bootstrap_coefs`, :func:`carry_spread`); empty in a
    # report from before they existed, which then skips that check
    boot: list[list[float]] = field(default_factory=list)
    # the largest work of any step fitted on ("prefill_tokens", "attention_pairs"): beyond it a
    # prediction is an extrapolation (:func:`advisor.autopilot.probe_stall_ms` says so); empty
    # in a report from before it existed
    seen: dict[str, int] = field(default_factory=dict)

    @property
    def poor(self) -> bool:
        return bool(self.quality.get("poor"))

    def step_seconds(self, work: StepWork) -> float:
        """Predicted seconds of a step doing ``work`` (never below zero)."""
        return max(0.0, self.model.predict(work))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FitReport:
        noise = d.get("noise")
        return cls(
            model=CostModel.from_dict(d["model"]),
            num_steps=int(d["num_steps"]),
            step_gap_s=float(d["step_gap_s"]),
            step_gap_p90_s=float(d.get("step_gap_p90_s", d["step_gap_s"])),
            selection=dict(d.get("selection") or {}),
            noise=NoiseModel(**noise) if isinstance(noise, dict) else None,
            num_outliers=int(d.get("num_outliers", 0)),
            rel_err_p50_all=float(d.get("rel_err_p50_all", 0.0)),
            rel_err_p95_all=float(d.get("rel_err_p95_all", 0.0)),
            quality=dict(d.get("quality") or {}),
            boot=[[float(v) for v in row] for row in d.get("boot") or ()],
            seen={str(k): int(v) for k, v in (d.get("seen") or {}).items()},
        )


def step_works(
    chunks: pd.DataFrame,
    image_requests: frozenset[str] = frozenset(),
    image_share: Mapping[str, float] | None = None,
) -> pd.DataFrame:
    """Per (engine, run, step): prefill tokens, decode tokens and attention pairs of its chunks,
    counted as ``StepWork.from_chunks`` counts them (vectorised); ``image_prefill_tokens``: the
    prefill tokens of requests in ``image_requests`` (those with images: the vision encoder
    runs in their prefill), a shape the fit's quality is checked on (:func:`fit_quality`);
    ``image_tokens``: the image placeholder tokens among the prefill tokens, counted from
    ``image_share`` (per request, the share of its prompt that is image tokens) as
    ``StepWork.from_chunks`` counts them."""
    cols = ["engine_id", "run_id", "step", "prefill_tokens", "decode_tokens", "attention_pairs"]
    cols += ["decode_pairs", "image_prefill_tokens", "image_tokens"]
    if chunks.empty:
        return pd.DataFrame({c: pd.Series(dtype="int64") for c in cols})
    n = chunks["num_tokens"].to_numpy(dtype=np.int64)
    s = chunks["start"].to_numpy(dtype=np.int64)
    decode = (chunks["kind"] == "decode").to_numpy()
    image = chunks["request_id"].isin(image_requests).to_numpy() if image_requests else False
    share = (
        chunks["request_id"].astype(str).map(image_share).fillna(0.0).to_numpy(dtype=np.float64)
        if image_share
        else np.zeros(len(chunks))
    )
    df = pd.DataFrame(
        {
            "engine_id": chunks["engine_id"].to_numpy(),
            "run_id": chunks["run_id"].to_numpy(),
            "step": chunks["step"].to_numpy(dtype=np.int64),
            "prefill_tokens": np.where(decode, 0, n),
            "decode_tokens": np.where(decode, n, 0),
            "attention_pairs": n * s + n * (n + 1) // 2,
            "decode_pairs": np.where(decode, n * s + n * (n + 1) // 2, 0),
            "image_prefill_tokens": np.where(~decode & image, n, 0),
            "image_tokens": np.where(decode, 0.0, n * share),
        }
    )
    out = df.groupby(["engine_id", "run_id", "step"], as_index=False, sort=True).sum()
    out["image_tokens"] = np.round(out["image_tokens"].to_numpy(dtype=np.float64)).astype("int64")
    return out


WORK_COLUMNS = (
    "prefill_tokens",
    "decode_tokens",
    "attention_pairs",
    "decode_pairs",
    "image_tokens",
)


def step_work_list(steps: pd.DataFrame) -> list[StepWork]:
    """One ``StepWork`` per row of a :func:`load_steps` frame (``decode_pairs`` and
    ``image_tokens`` 0 if absent)."""
    zero = pd.Series(0, index=steps.index)
    dp = steps["decode_pairs"] if "decode_pairs" in steps else zero
    it = steps["image_tokens"] if "image_tokens" in steps else zero
    return [
        StepWork(int(p), int(d), int(a), int(q), int(i))
        for p, d, a, q, i in zip(
            steps["prefill_tokens"],
            steps["decode_tokens"],
            steps["attention_pairs"],
            dp,
            it,
            strict=True,
        )
    ]


def busy_gaps_s(steps: pd.DataFrame) -> np.ndarray:
    """Seconds from each step's end to the next step's start, for steps after which the engine
    still had requests (so it did not wait for work) - per run, consecutive step numbers only."""
    out: list[np.ndarray] = []
    for _, g in steps.groupby(["engine_id", "run_id"], sort=False):
        g = g.sort_values("step")
        step = g["step"].to_numpy(dtype=np.int64)
        start = g["start_ns"].to_numpy(dtype=np.int64)
        end = g["end_ns"].to_numpy(dtype=np.int64)
        busy = (g["num_running"].fillna(0) + g["num_waiting"].fillna(0)).to_numpy() > 0
        ok = (np.diff(step) == 1) & busy[:-1]
        gap = (start[1:] - end[:-1])[ok]
        out.append(gap[gap >= 0] / 1e9)
    return np.concatenate(out) if out else np.empty(0)


def image_shares(reqs: pd.DataFrame) -> dict[str, float]:
    """Per request with images: the share of its prompt that is image placeholder tokens."""
    if reqs.empty or "num_image_tokens" not in reqs:
        return {}
    img = reqs["num_image_tokens"].fillna(0).to_numpy(dtype=np.float64)
    prompt = reqs["num_prompt_tokens"].fillna(0).to_numpy(dtype=np.float64)
    ok = (img > 0) & (prompt > 0)
    ids = reqs["request_id"].astype(str).to_numpy()
    rows = zip(ids[ok], img[ok], prompt[ok], strict=True)
    return {str(i): float(min(1.0, a / b)) for i, a, b in rows}


def load_steps(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> pd.DataFrame:
    """The selected steps with their work: the columns of ``queries.steps`` plus
    ``prefill_tokens``, ``decode_tokens``, ``attention_pairs``, ``image_prefill_tokens``."""
    steps = queries.steps(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    if steps.empty:
        return steps.assign(
            prefill_tokens=[],
            decode_tokens=[],
            attention_pairs=[],
            decode_pairs=[],
            image_prefill_tokens=[],
            image_tokens=[],
        )
    reqs = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    images = frozenset(
        reqs.loc[reqs["num_image_tokens"].fillna(0) > 0, "request_id"].astype(str)
        if not reqs.empty
        else ()
    )
    share = image_shares(reqs)
    works = []
    for (eid, rid), g in steps.groupby(["engine_id", "run_id"], sort=False):
        chunks = queries.step_chunks(
            db,
            engine_id=eid,
            run_id=rid,
            step_from=int(g["step"].min()),
            step_to=int(g["step"].max()),
        )
        works.append(step_works(chunks, images, share))
    work = pd.concat(works, ignore_index=True) if works else step_works(pd.DataFrame())
    merged = steps.merge(work, on=["engine_id", "run_id", "step"], how="left")
    for c in (*WORK_COLUMNS, "image_prefill_tokens"):
        merged[c] = merged[c].fillna(0).astype("int64")
    return merged


TRIM_K = 3.0  # robust standard deviations of log(measured / predicted) kept
TRIM_ROUNDS = 4


def relative_fit(works: list[StepWork], measured: Any) -> CostModel:
    """``engine.core.cost_model.fit``'s model, solved for the least squared *relative* error
    (each step weighted by 1 / its duration): a 5 ms decode step then counts as much as a 500 ms
    prefill step, instead of a 10,000th of it - and the inter-token latency is made of the
    short steps. Coefficients kept non-negative the same way (a negative one fixed at zero and
    the others refitted)."""
    y = np.asarray(measured, dtype=np.float64)
    return fit(works, list(y), weights=list(1.0 / np.maximum(y, 1e-6)))


def sqrt_fit(works: list[StepWork], measured: Any) -> CostModel:
    """Least squares with each step weighted by 1 / sqrt(its duration): between ``ols`` (a
    500 ms step counts 10,000 times a 5 ms one) and :func:`relative_fit` (equal), a 500 ms
    step counts 100 times a 5 ms one."""
    y = np.asarray(measured, dtype=np.float64)
    return fit(works, list(y), weights=list(1.0 / np.sqrt(np.maximum(y, 1e-6))))


# the default: short steps (the inter-token latency) and long ones (the queue, TTFT) both
# count (issue 19a: with OLS the fit missed decode steps of one sequence by 10-30% in the
# steps it was fitted on, a 500 ms step weighing as 10,000 of them)
DEFAULT_METHOD = "sqrt"
FITTERS = {
    "ols": lambda works, y: fit(works, list(y)),
    "relative": relative_fit,
    "sqrt": sqrt_fit,
}


def robust_fit(
    works: list[StepWork], measured: np.ndarray, method: str = DEFAULT_METHOD
) -> tuple[CostModel, np.ndarray]:
    """Least squares on the steps that behave like the model: fit, drop the steps whose
    log(measured / predicted) is more than ``TRIM_K`` robust standard deviations (1.4826 MAD)
    from the median, refit, a few rounds. A step that another process or a pause stretched tenfold
    says nothing about what the work costs, and least squares would let it pull every
    coefficient (the scatter it stands for is kept by the noise model instead). Returns the model
    and the mask of the steps it was fitted on."""
    solve = FITTERS[method]
    n = len(works)
    keep = np.ones(n, dtype=bool)
    model = solve(works, measured)
    for _ in range(TRIM_ROUNDS):
        pred = model.predict_many(works)
        ok = (pred > 0) & (measured > 0)
        lr = np.full(n, np.inf)
        lr[ok] = np.log(measured[ok] / pred[ok])
        ref = lr[keep & np.isfinite(lr)]
        if ref.size < len(FEATURES):
            break
        med = float(np.median(ref))
        sigma = max(1.4826 * float(np.median(np.abs(ref - med))), 0.01)
        new = np.isfinite(lr) & (np.abs(lr - med) <= TRIM_K * sigma)
        if new.sum() < len(FEATURES) or np.array_equal(new, keep):
            break
        keep = new
        model = solve([w for w, k in zip(works, keep, strict=True) if k], measured[keep])
    return model, keep


# A fit that cannot carry a prediction (:func:`fit_quality`); a reason each.
POOR_REL_ERR_P50 = 0.25  # the model misses a typical step by more than this
SHAPE_RATIO = (0.8, 1.25)  # a step shape's median measured / predicted outside: a missing term
SHAPE_MIN_STEPS = 5
MIN_PREFILL_STEPS = 8  # fewer: the cost of a chunk is not pinned down, other budgets guessed
DRIFT_RATIO = 1.5  # decode steps' measured / predicted, slowest third over fastest
DRIFT_MIN_STEPS = 10  # per third
CHEAPEST_MIN_STEPS = 5


def fit_quality(
    model: CostModel,
    measured: np.ndarray,
    predicted: np.ndarray,
    *,
    prefill: np.ndarray,
    decode: np.ndarray,
    image_prefill: np.ndarray,
    start_ns: np.ndarray,
    calibration_prefill_steps: int = 0,
) -> dict[str, Any]:
    """Whether a fit can carry a prediction to other budgets, and why not: the residuals per
    step shape (decode only, prefill, prefill of requests with images: the vision encoder),
    the constant against the engine's cheapest steps, the machine's speed across the fit
    window and the number of prefill steps. ``{"poor", "reasons", "by_shape", "cheapest_ms",
    "drift"}``; a poor fit makes no recommendation (``advisor.predict``)."""
    reasons: list[str] = []
    ok = predicted > 0
    ratio = np.where(ok, measured / np.where(ok, predicted, 1.0), np.inf)
    rel = np.abs(predicted - measured) / np.maximum(measured, 1e-9)
    shapes = np.where(
        prefill == 0, "decode", np.where(image_prefill > 0, "vision prefill", "prefill")
    )
    by_shape: dict[str, dict[str, Any]] = {}
    for name in ("decode", "prefill", "vision prefill"):
        m = shapes == name
        if not m.any():
            continue
        r = float(np.median(ratio[m]))
        by_shape[name] = {
            "num_steps": int(m.sum()),
            "measured_ms_p50": float(np.median(measured[m]) * 1e3),
            "ratio_p50": r,
            "rel_err_p50": float(np.median(rel[m])),
        }
        lo, hi = SHAPE_RATIO
        if m.sum() >= SHAPE_MIN_STEPS and not lo <= r <= hi:
            reasons.append(
                f"{name} steps took {r:.2f}x the model's prediction (median of {int(m.sum())}): "
                "a cost the model has no term for"
            )
    rel_p50 = float(np.median(rel)) if rel.size else 0.0
    if rel_p50 > POOR_REL_ERR_P50:
        reasons.append(
            f"relative error p50 {100 * rel_p50:.0f}% (over {100 * POOR_REL_ERR_P50:.0f}%)"
        )
    # a calibration's steps (``advisor.calibrate``) pin the chunk cost down as well
    n_prefill = int((prefill > 0).sum()) + calibration_prefill_steps
    if n_prefill < MIN_PREFILL_STEPS:
        reasons.append(
            f"only {n_prefill} steps with prefill (needs {MIN_PREFILL_STEPS}): the cost of a "
            "chunk is not pinned down, so other budgets would be guessed"
        )
    # the cheapest steps the engine ran: decode only, fewest tokens (at least a few of them)
    cheapest_ms: float | None = None
    dec_only = prefill == 0
    for k in np.unique(decode[dec_only]):
        m = dec_only & (decode == k)
        if m.sum() >= CHEAPEST_MIN_STEPS:
            cheapest_ms = float(np.median(measured[m]) * 1e3)
            if model.const * 1e3 > cheapest_ms:
                reasons.append(
                    f"per-step constant {model.const * 1e3:.1f} ms is above the {cheapest_ms:.1f} "
                    f"ms the engine's cheapest steps took (decode of {int(k)}): the fit absorbed "
                    "something other than the work (load on the machine)"
                )
            break
    # the machine's speed across the window: decode steps' ratio per third of the window
    drift: list[float] = []
    order = np.argsort(start_ns[dec_only], kind="stable")
    dec_ratio = ratio[dec_only][order]
    if dec_ratio.size >= 3 * DRIFT_MIN_STEPS:
        drift = [float(np.median(part)) for part in np.array_split(dec_ratio, 3)]
        if min(drift) > 0 and max(drift) / min(drift) > DRIFT_RATIO:
            reasons.append(
                "the machine's speed changed during the fit window: decode steps took "
                + " / ".join(f"{d:.2f}x" for d in drift)
                + " the prediction in its three thirds"
            )
    return {
        "poor": bool(reasons),
        "reasons": reasons,
        "by_shape": by_shape,
        "cheapest_ms": cheapest_ms,
        "const_ms": model.const * 1e3,
        "drift": drift,
        "num_prefill_steps": n_prefill,
    }


BOOT_RESAMPLES = 40
BOOT_SEED = 0
# a budget whose predicted prefill cost moves more than this (p10 to p90 over the resampled
# fits, relative to their median) is a budget the fit window does not pin down
CARRY_SPREAD = 0.15


def bootstrap_coefs(
    works: list[StepWork],
    measured: np.ndarray,
    method: str = DEFAULT_METHOD,
    resamples: int = BOOT_RESAMPLES,
    seed: int = BOOT_SEED,
) -> list[list[float]]:
    """The model refitted (:func:`robust_fit`, its trimming included) on ``resamples``
    resamples of the steps drawn with replacement (seeded): one coefficient list each, in
    ``FEATURES`` order. Their spread is how well the steps pin each cost down: a window with a
    handful of long prefill steps, some of them slowed by something else on the machine, fits
    a prefill cost that moves with which of them a resample keeps."""
    rng = np.random.default_rng(seed)
    n = len(works)
    out: list[list[float]] = []
    for _ in range(resamples if n >= len(FEATURES) else 0):
        idx = rng.integers(0, n, n)
        m, _ = robust_fit([works[i] for i in idx], measured[idx], method)
        out.append([float(v) for v in m.coefficients()])
    return out


def prefill_work(prompts: Sequence[tuple[int, int]], budget: int) -> tuple[int, int, int]:
    """(chunks, prefill tokens, attention pairs) of prefilling ``prompts`` ((prompt tokens,
    cached tokens) each) in chunks of at most ``budget`` tokens, one request at a time."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    chunks = tokens = pairs = 0
    for prompt, cached in prompts:
        start = max(0, min(cached, prompt - 1))
        while start < prompt:
            n = min(budget, prompt - start)
            chunks += 1
            tokens += n
            pairs += chunk_pairs(start, n)
            start += n
    return chunks, tokens, pairs


def carry_spread(
    boot: Sequence[Sequence[float]], prompts: Sequence[tuple[int, int]], budget: int
) -> float | None:
    """How far the resampled fits (``FitReport.boot``) disagree on the cost of prefilling
    ``prompts`` at ``budget``: (p90 - p10) / median of the summed step times (``None``
    without resamples or prompts). The fit window's own chunk size is pinned down by its
    steps; a budget whose chunks it never ran is extrapolated, and this says how far."""
    if len(boot) < 5 or not prompts:
        return None
    chunks, tokens, pairs = prefill_work(prompts, budget)
    x = np.array([chunks, tokens, 0.0, pairs, 0.0])
    t = np.array(boot, dtype=np.float64)[:, : len(x)] @ x
    med = float(np.median(t))
    if med <= 0:
        return None
    return float((np.quantile(t, 0.9) - np.quantile(t, 0.1)) / med)


# the calibration's level is matched on prefill steps of at least this many tokens: a
# window's shorter prefill steps (a chat prompt of 50-150 tokens beside a few decodes) are
# mostly fixed cost and decodes, where the model's own bias shows, not the machine's speed
# (issue 19, Zen 5 holdout run at 38f0d85: such steps ran 1.11-1.32x the joint fit in all three
# baselines, their 1,024-token chunks 0.93-0.96x; matched on all prefill steps, the level came
# out 1.11-1.14 and other budgets' 128- and 512-token chunks ran 0.89-0.91x their prediction)
LEVEL_MIN_PREFILL = 128
LEVEL_MIN_STEPS = 3  # fewer such steps in the window: the level from all its prefill steps
CAL_DRIFT_WARN = 0.15  # calibration and window levels further apart than this: said so
# further apart than this: the machine's speed changed between the calibration and the window
# (other work on it), and a prediction would carry that change: the fit is poor
CAL_DRIFT_POOR = 0.3


def calibration_fit(
    works: list[StepWork],
    measured: np.ndarray,
    cal_works: list[StepWork],
    cal_measured: np.ndarray,
    method: str = DEFAULT_METHOD,
) -> tuple[CostModel, np.ndarray, dict[str, Any], list[StepWork], np.ndarray]:
    """The window's steps and a calibration's, fitted together. The calibration ran at
    another moment (the machine's speed moves with the load on it) and on an idle engine, so
    its level is matched to the window's first: a fit on both, then the calibration's times
    scaled by ``level`` = (the window's prefill steps' median measured / predicted) over (the
    calibration's prefill steps' median), and refitted; both sides count only steps of at
    least ``LEVEL_MIN_PREFILL`` prefill tokens where the window has ``LEVEL_MIN_STEPS`` of
    them (all prefill steps otherwise: ``info["level_min_prefill_tokens"]`` says which). The
    calibration then sets how the cost grows with chunk size and context, the window how fast
    the machine is. ``level`` is kept within [0.5, 2]; without prefill steps in the window it
    is the decode-free part's best guess, 1.
    Returns the model, the inlier mask (window steps first), a summary, and the steps and
    times the model was fitted on."""
    all_works = works + cal_works
    model, _ = robust_fit(all_works, np.concatenate([measured, cal_measured]), method)
    # the level compares like with like: the window's steps of at least LEVEL_MIN_PREFILL
    # prefill tokens against the calibration's (all its prefill steps when the window has
    # fewer than LEVEL_MIN_STEPS of them)
    floor = LEVEL_MIN_PREFILL
    win_prefill = np.array([w.prefill_tokens >= floor for w in works])
    if win_prefill.sum() < LEVEL_MIN_STEPS or not any(w.prefill_tokens >= floor for w in cal_works):
        floor = 1
        win_prefill = np.array([w.prefill_tokens > 0 for w in works])
    level = 1.0
    raw = None
    if win_prefill.any():
        pw = model.predict_many([w for w, p in zip(works, win_prefill, strict=True) if p])
        # prefill against prefill (a calibration's decode batches are not what the window's
        # prefill steps are)
        cal_prefill = np.array([w.prefill_tokens >= floor for w in cal_works])
        pc = model.predict_many(cal_works)
        okw, okc = pw > 0, (pc > 0) & cal_prefill
        if okw.any() and okc.any():
            rw = float(np.median(measured[win_prefill][okw] / pw[okw]))
            rc = float(np.median(cal_measured[okc] / pc[okc]))
            raw = rw / rc
            level = float(np.clip(raw, 0.5, 2.0))
    scaled = cal_measured * level
    y = np.concatenate([measured, scaled])
    model, inliers = robust_fit(all_works, y, method)
    pc = model.predict_many(cal_works)
    ok = pc > 0
    info = {
        "num_steps": len(cal_works),
        "level": level,
        "level_raw": raw,
        "num_window_prefill_steps": int(win_prefill.sum()),
        "level_min_prefill_tokens": floor,
        "ratio_p50_after": float(np.median(scaled[ok] / pc[ok])) if ok.any() else None,
        "drift": bool(raw is not None and abs(raw - 1.0) > CAL_DRIFT_WARN),
    }
    return model, inliers, info, all_works, y


def _usable(steps: pd.DataFrame) -> pd.DataFrame:
    return steps[(steps["end_ns"] >= steps["start_ns"]) & (steps["num_scheduled_tokens"] > 0)]


def _seconds(steps: pd.DataFrame) -> np.ndarray:
    return (steps["end_ns"] - steps["start_ns"]).to_numpy(dtype=np.int64) / 1e9


NOISE_BINNING = "duration"  # noise_model's binning for fits
NOISE_WITH_CALIBRATION = False  # the calibration's steps (level-matched) join the noise pool


def _noise(
    model: CostModel,
    works: list[StepWork],
    measured: np.ndarray,
    fit_works: list[StepWork],
    fit_measured: np.ndarray,
    gaps: np.ndarray,
) -> NoiseModel:
    """The noise model of a fit: the window's steps' scatter around ``model`` (and the
    calibration's, when ``NOISE_WITH_CALIBRATION``: ``fit_works`` holds the window's steps
    first, then the calibration's)."""
    if NOISE_WITH_CALIBRATION and len(fit_works) > len(works):
        return noise_model(model.predict_many(fit_works), fit_measured, gaps, binning=NOISE_BINNING)
    return noise_model(model.predict_many(works), measured, gaps, binning=NOISE_BINNING)


NOISE_RECENT_MIN_STEPS = 50  # fewer steps than this in the recent window: the fit window's scatter


def recent_noise(
    report: FitReport, steps: pd.DataFrame, *, min_steps: int = NOISE_RECENT_MIN_STEPS
) -> NoiseModel | None:
    """The scatter of ``steps`` (the last seconds, from :func:`load_steps`) around ``report``'s
    model, and their pauses; for steps longer than any of them (by more than a bin's width,
    ``NOISE_FACTOR``) the fit window's own bins. None when they are fewer than ``min_steps``.

    The fit needs minutes of steps to pin its costs down, but the machine's speed and scatter
    move within a minute (other work, the engine's own bursts). Drawn from the 30 s before a
    window instead of the fit window's, the chat ITL p99 predicted for the autopilot's own
    windows came closer to the store's on nine of ten kept runs, further on one (median error
    16.5% -> 14.0%; ``benchmarks/autopilot_nowcast.py``, docs/benchmarks.md, "The scatter of
    the last seconds"). Long steps keep the fit window's scatter: a quiet window has none of
    them, and long steps scatter less than short ones (issue 19d)."""
    return _recent_noise(report, steps, _usable(steps), min_steps)


def _recent_noise(
    report: FitReport, steps: pd.DataFrame, usable: pd.DataFrame, min_steps: int
) -> NoiseModel | None:
    """:func:`recent_noise` with ``usable`` (``_usable(steps)``) already selected."""
    if len(usable) < min_steps or report.noise is None:
        return None
    now = noise_model(
        report.model.predict_many(step_work_list(usable)),
        _seconds(usable),
        busy_gaps_s(steps),
        binning=NOISE_BINNING,
    )
    if not now.ratios:
        return None
    top = now.edges_s[-1] * NOISE_FACTOR
    old = report.noise
    longer = [(e, r) for e, r in zip(old.edges_s, old.ratios, strict=True) if e > top]
    return NoiseModel(
        now.edges_s + [e for e, _ in longer],
        now.ratios + [r for _, r in longer],
        now.gaps_s or old.gaps_s,
    )


def with_recent_noise(report: FitReport, steps: pd.DataFrame) -> tuple[FitReport, int]:
    """``report`` with :func:`recent_noise` of ``steps`` when there is one, and how many steps
    it was drawn from (0: the fit window's scatter is kept)."""
    usable = _usable(steps)  # selected once: it is also the count
    noise = _recent_noise(report, steps, usable, NOISE_RECENT_MIN_STEPS)
    if noise is None:
        return report, 0
    return replace(report, noise=noise), len(usable)


def _with_calibration(quality: dict[str, Any], cal: dict[str, Any]) -> dict[str, Any]:
    """``quality`` with the calibration's summary, poor when its level is far from 1."""
    if not cal:
        return quality
    out = {**quality, "calibration": cal}
    raw = cal.get("level_raw")
    if raw is not None and abs(raw - 1.0) > CAL_DRIFT_POOR:
        out["poor"] = True
        out["reasons"] = [
            *(quality.get("reasons") or ()),
            f"the window's prefill steps took {raw:.2f}x what the calibration's took for the "
            "same work: the machine's speed changed between them (other work on it)",
        ]
    return out


def fit_steps(
    steps: pd.DataFrame,
    selection: dict[str, Any] | None = None,
    method: str = DEFAULT_METHOD,
    resamples: int = BOOT_RESAMPLES,
    calibration: pd.DataFrame | None = None,
) -> FitReport:
    """Fit the cost model to steps as returned by :func:`load_steps`; ``resamples`` refits on
    resampled steps for ``FitReport.boot`` (0: none, and no :func:`carry_spread` check).

    ``calibration``: steps of a calibration (``advisor.calibrate``: long prefill chunks of
    every budget's size on the idle engine), fitted together with ``steps`` after their level
    is matched to the window's (:func:`calibration_fit`); the noise model, the pauses and the
    fit's verdict are the window's own."""
    usable = _usable(steps)
    if len(usable) < 4:
        raise FitError(f"need at least 4 steps with tokens to fit, the selection has {len(usable)}")
    works = step_work_list(usable)
    measured = _seconds(usable)
    cal_info: dict[str, Any] = {}
    cal = _usable(calibration) if calibration is not None else None
    if cal is not None and len(cal) >= len(FEATURES):
        cal_works = step_work_list(cal)
        model, inliers, cal_info, fit_works, fit_measured = calibration_fit(
            works, measured, cal_works, _seconds(cal), method
        )
    else:
        model, inliers = robust_fit(works, measured, method)
        fit_works, fit_measured = works, measured
    gaps = busy_gaps_s(steps)
    predicted = model.predict_many(works)
    rel_all = np.abs(predicted - measured) / np.maximum(measured, 1e-9)
    image = (
        usable["image_prefill_tokens"].to_numpy(dtype=np.int64)
        if "image_prefill_tokens" in usable
        else np.zeros(len(usable), dtype=np.int64)
    )
    quality = fit_quality(
        model,
        measured,
        predicted,
        prefill=usable["prefill_tokens"].to_numpy(dtype=np.int64),
        decode=usable["decode_tokens"].to_numpy(dtype=np.int64),
        image_prefill=image,
        start_ns=usable["start_ns"].to_numpy(dtype=np.int64),
        calibration_prefill_steps=int(cal_info.get("num_steps", 0)),
    )
    report = FitReport(
        model=model,
        num_steps=len(works),
        num_outliers=int((~inliers[: len(works)]).sum()),
        rel_err_p50_all=float(np.percentile(rel_all, 50)),
        rel_err_p95_all=float(np.percentile(rel_all, 95)),
        step_gap_s=float(np.median(gaps)) if gaps.size else 0.0,
        step_gap_p90_s=float(np.percentile(gaps, 90)) if gaps.size else 0.0,
        selection=dict(selection or {}),
        noise=_noise(model, works, measured, fit_works, fit_measured, gaps),
        quality=_with_calibration(quality, cal_info),
        boot=bootstrap_coefs(fit_works, fit_measured, method, resamples),
        seen={
            "prefill_tokens": max(w.prefill_tokens for w in fit_works),
            "attention_pairs": max(w.attention_pairs for w in fit_works),
        },
    )
    if quality["poor"]:
        logger.warning("poor fit of the step-cost model: %s", "; ".join(quality["reasons"]))
    logger.info(
        "cost model from %d steps (%d outliers left out): const %.3g s, prefill %.3g s/token, "
        "decode %.3g s/token, attention %.3g s/pair (+ %.3g s/decode pair); relative error p50 "
        "%.1f%% p95 %.1f%%, R^2 %.3f; gap %.3g s",
        report.num_steps,
        report.num_outliers,
        model.const,
        model.prefill,
        model.decode,
        model.attn,
        model.attn_decode,
        100 * model.rel_err_p50,
        100 * model.rel_err_p95,
        model.r2,
        report.step_gap_s,
    )
    return report


def fit_from_store(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    method: str = DEFAULT_METHOD,
    resamples: int = BOOT_RESAMPLES,
    calibration: Sequence[tuple[float, float]] = (),
) -> FitReport:
    """Fit the cost model to the steps of the selection (see ``storage.queries`` for filters);
    ``method`` "sqrt" (:func:`sqrt_fit`, the default), "ols" (``engine.core.cost_model.fit``)
    or "relative" (:func:`relative_fit`);
    ``resamples`` as :func:`fit_steps`; ``calibration``: (since, until) spans of the same
    engine whose steps a calibration ran (``advisor.calibrate``), fitted with the window's."""
    steps = load_steps(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    selection: dict[str, Any] = {
        "engine_id": engine_id,
        "run_id": run_id,
        "since": since,
        "until": until,
    }
    cal = None
    if calibration:
        parts = [
            load_steps(db, engine_id=engine_id, run_id=run_id, since=a, until=b)
            for a, b in calibration
        ]
        cal = pd.concat(parts, ignore_index=True)
        selection["calibration"] = [[float(a), float(b)] for a, b in calibration]
    return fit_steps(steps, {**selection, "method": method}, method, resamples, cal)
