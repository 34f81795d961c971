"""Prediction end to end: fit the cost model from the store, read the traffic of a window,
simulate it at each budget, and recommend. The document it returns is what ``python -m advisor
predict --out FILE`` writes and what ``python -m loadgen sweep --predictions FILE`` reads."""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from advisor.client import ClientDelay, ClientDraw, load_client_delay
from advisor.fit import CARRY_SPREAD, DEFAULT_METHOD, FitReport, carry_spread, fit_from_store
from advisor.overload import WindowLoad
from advisor.pareto import front_budgets, front_pairs
from advisor.recommend import Recommendation, Slo, recommend
from advisor.simulate import (
    GapTime,
    StepTime,
    cost_model_step_ns,
    drawn_gap_ns,
    noisy_step_ns,
    predict_budgets,
)
from advisor.traffic import (
    engine_shape,
    observed_load,
    observed_traffic,
    shape_dict,
    to_sim_requests,
)

logger = logging.getLogger(__name__)

TOOL = "chunkscope-advisor"


def predict_from_store(
    db_url: str,
    budgets: Sequence[int],
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    fit_since: float | None = None,
    fit_until: float | None = None,
    slo: Slo | None = None,
    step_gap: bool = True,
    noise: bool = True,
    seed: int = 0,
    warmup_s: float = 0.0,
    fit_method: str = DEFAULT_METHOD,
    client: ClientDelay | str | None = None,
    max_steps: int | None = 2_000_000,
    caps: Sequence[int] = (0,),
    allow_poor_fit: bool = False,
    draws: int = 1,
    calibration: Sequence[tuple[float, float]] = (),
) -> dict[str, Any]:
    """Predicted figures per budget (and long-prefill cap, ``caps``) for the traffic of
    [since, until], measured from ``since + warmup_s`` (as a sweep window discards its
    warm-up), step times from a fit on the steps of [fit_since, fit_until] (default: the same
    window). ``client`` (a ``ClientDelay``
    or the path of a ``python -m loadgen --out`` result against this engine) adds the
    client's delivery, so the figures are what a load generator would measure.
    ``calibration``: (since, until) spans of a calibration on the same engine
    (``advisor.calibrate``) whose steps the fit adds (``advisor.fit.fit_from_store``)."""
    if isinstance(client, str):
        client = load_client_delay(client)
    from storage import db as dbm

    slo = slo or Slo()
    db = dbm.connect(db_url, readonly=True)
    try:
        fsince = since if fit_since is None else fit_since
        funtil = until if fit_until is None else fit_until
        report = fit_from_store(
            db,
            engine_id=engine_id,
            run_id=run_id,
            since=fsince,
            until=funtil,
            method=fit_method,
            calibration=calibration,
        )
        traffic = observed_traffic(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
        load = observed_load(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
        shape = engine_shape(db, engine_id=engine_id, run_id=run_id)
    finally:
        db.dispose()
    return predict_traffic(
        report,
        traffic,
        shape,
        budgets,
        slo=slo,
        step_gap=step_gap,
        noise=noise,
        seed=seed,
        warmup_s=warmup_s,
        client=client,
        max_steps=max_steps,
        caps=caps,
        observed=load,
        allow_poor_fit=allow_poor_fit,
        draws=draws,
        selection={
            "db": _redact(db_url),
            "engine_id": engine_id,
            "run_id": run_id,
            "since": since,
            "until": until,
            "fit_since": fsince,
            "fit_until": funtil,
        },
    )


def predict_traffic(
    report: FitReport,
    traffic: Any,
    shape: Any,
    budgets: Sequence[int],
    *,
    slo: Slo,
    step_gap: bool = True,
    noise: bool = True,
    seed: int = 0,
    warmup_s: float = 0.0,
    client: ClientDelay | None = None,
    max_steps: int | None = 2_000_000,
    selection: dict[str, Any] | None = None,
    caps: Sequence[int] = (0,),
    observed: WindowLoad | None = None,
    allow_poor_fit: bool = False,
    draws: int = 1,
) -> dict[str, Any]:
    """Simulate ``traffic`` at each budget with step times from ``report``: its prediction
    times the measured scatter (``noise``, seeded draws) and the measured pauses between steps
    (``step_gap``), or the bare prediction and the median pause. ``caps``: long-prefill caps
    tried beside each budget (0 = off); the recommendation is then a (budget, cap) pair.
    ``observed``: the load of the window the traffic was read from; when it was overloaded
    (``advisor.overload``) the traffic is not what was offered, and nothing is recommended.
    A poor fit (``FitReport.quality``, ``advisor.fit.fit_quality``) recommends nothing either
    (the figures are still given, flagged) unless ``allow_poor_fit``. ``draws`` > 1 simulates
    each budget that many times with successive seeds (other draws of the scatter) and gives
    each figure's median: a simulated window's p99 and max are themselves random, and one draw
    can land far from what the model says (:func:`median_windows`)."""
    if not traffic.requests:
        raise ValueError("no request arrived in the selected window: nothing to simulate")
    reqs, warm = to_sim_requests(traffic, shape.block_size)
    shares = image_share_of(traffic)
    if draws < 1:
        raise ValueError(f"draws must be at least 1, got {draws}")
    t0 = time.perf_counter()
    runs = [
        predict_budgets(
            reqs,
            shape,
            sorted({int(b) for b in budgets}),
            timing=partial(
                step_timing,
                report,
                step_gap=step_gap,
                noise=noise,
                seed=seed + k,
                image_share=shares,
            ),
            warm_prefixes=warm,
            max_steps=max_steps,
            window_ns=(round(warmup_s * 1e9), max(round(traffic.duration_s * 1e9), 1)),
            client=None if client is None else partial(ClientDraw, client, seed + 1 + k),
            caps=caps,
            image_requests=shares.keys(),
        )
        for k in range(draws)
    ]
    windows = median_windows(runs)
    sim_s = time.perf_counter() - t0
    quality = fit_carry(report, traffic, budgets)
    rec = recommend(windows, slo, "predicted")
    if quality.get("poor") and not allow_poor_fit:
        rec = Recommendation(
            None,
            "predicted",
            False,
            None,
            "predicted: no recommendation, poor fit of the step-cost model ("
            + "; ".join(quality.get("reasons") or ())
            + "): a decision it cannot support is not made",
        )
    if observed is not None and observed.overloaded:
        rec = Recommendation(
            None,
            "predicted",
            False,
            None,
            f"predicted: no recommendation, the observed window was overloaded "
            f"({observed.reason()}): its traffic is not what was offered",
        )
    return {
        "tool": TOOL,
        "created": time.time(),
        "selection": selection or {},
        "fit": report.to_dict(),
        "fit_quality": quality,
        "engine_shape": shape_dict(shape),
        "traffic": traffic.summary(),
        "slo": slo.to_dict(),
        "observed_window": None if observed is None else observed.to_dict(),
        "measured_from_s": warmup_s,
        "client": None if client is None else client.summary(),
        "figures_seen_by": "engine" if client is None else "client",
        "simulation_s": sim_s,
        "draws": draws,
        "windows": windows,
        "pareto_budgets": front_budgets(windows),
        "pareto_pairs": front_pairs(windows),
        "recommendation": rec.to_dict(),
        "recommended_budget": rec.budget,
        "recommended_cap": rec.cap,
        "recommendation_source": rec.source,
        "reason": rec.reason,
    }


def fit_carry(report: FitReport, traffic: Any, budgets: Sequence[int]) -> dict[str, Any]:
    """``report.quality`` plus ``carry``: per budget, how far the resampled fits
    (``FitReport.boot``) disagree on the cost of prefilling this traffic's prompts at that
    budget (``advisor.fit.carry_spread``). A spread above ``CARRY_SPREAD`` makes the fit poor
    for this prediction: its figures would follow which of a few steps the fit leaned on."""
    quality = dict(report.quality)
    prompts = [(r.num_prompt_tokens, r.num_cached_tokens) for r in traffic.requests]
    spread = {int(b): carry_spread(report.boot, prompts, int(b)) for b in sorted(set(budgets))}
    quality["carry"] = {str(b): v for b, v in spread.items()}
    worst = max(((v, b) for b, v in spread.items() if v is not None), default=None)
    if worst is not None and worst[0] > CARRY_SPREAD:
        quality["poor"] = True
        quality["reasons"] = [
            *(quality.get("reasons") or ()),
            f"the steps do not pin the prefill cost down: fits on resamples of them disagree "
            f"by {100 * worst[0]:.0f}% (p10 to p90, over {100 * CARRY_SPREAD:.0f}%) on this "
            f"traffic's prefill at budget {worst[1]}",
        ]
    return quality


RANGE_KEYS = ("itl_p99_ms", "itl_p999_ms", "itl_max_ms", "ttft_p99_ms")


def median_windows(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The windows of several draws of the same simulations, each number the median over the
    draws (None when any draw has none); everything else (budget, cap, verdicts, per-class
    dicts) from the first draw, except ``overloaded``, true when most draws say so.

    Beside the medians, ``draw_range``: the lowest and highest draw of each tail figure
    (``RANGE_KEYS``). A wide range is a tail the traffic sits on the edge of (a chat ITL p99
    where the stall gaps are about 1% of the gaps moves several-fold with one gap), which a
    median alone hides."""
    if len(runs) == 1:
        return [dict(w) for w in runs[0]]
    out = []
    for ws in zip(*runs, strict=True):
        merged = dict(ws[0])
        spread: dict[str, list[float]] = {}
        for key, v in ws[0].items():
            if key in ("budget", "cap") or isinstance(v, bool):
                continue
            vals = [w.get(key) for w in ws]
            if all(isinstance(x, int | float) and not isinstance(x, bool) for x in vals):
                merged[key] = float(statistics.median(vals))
                if key in RANGE_KEYS:
                    spread[key] = [float(min(vals)), float(max(vals))]
        merged["draw_range"] = spread
        votes = sum(bool(w.get("overloaded")) for w in ws)
        if votes * 2 > len(ws) and not merged.get("overloaded"):
            first = next(w for w in ws if w.get("overloaded"))
            merged["overloaded"] = True
            merged["overload_reason"] = first.get("overload_reason")
        elif votes * 2 <= len(ws) and merged.get("overloaded"):
            merged["overloaded"] = False
            merged["overload_reason"] = None
        out.append(merged)
    return out


def step_timing(
    report: FitReport,
    *,
    step_gap: bool = True,
    noise: bool = True,
    seed: int = 0,
    image_share: Mapping[str, float] | None = None,
) -> tuple[StepTime, int | GapTime]:
    """The (step time, pause) functions of one simulation; ``image_share`` (per request id,
    the share of its prompt that is image tokens: :func:`image_share_of`) gives the vision
    encoder's term its work (without it, image tokens cost what text prefill tokens do)."""
    rng = random.Random(seed)
    n = report.noise
    if noise and n is not None and n.ratios:
        step = noisy_step_ns(report.step_seconds, n.edges_s, n.ratios, rng, image_share)
    else:
        step = cost_model_step_ns(report.step_seconds, image_share)
    if not step_gap:
        return step, 0
    if noise and n is not None and n.gaps_s:
        return step, drawn_gap_ns(n.gaps_s, rng)
    return step, round(report.step_gap_s * 1e9)


def image_share_of(traffic: Any) -> dict[str, float]:
    """Per request of ``traffic`` with images: the share of its prompt that is image tokens."""
    return {
        str(r.request_id): min(1.0, r.num_image_tokens / r.num_prompt_tokens)
        for r in traffic.requests
        if r.num_image_tokens > 0 and r.num_prompt_tokens > 0
    }


def _redact(url: str) -> str:
    """A database URL without its password."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url
