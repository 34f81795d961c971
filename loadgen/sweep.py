"""`python -m loadgen sweep`: one window of traffic per token budget (or (budget, cap) pair),
the figures of each measured on the client.

The traffic (a profile or a trace) is planned for ``len(budgets) * window_s`` seconds (or, with
``--same-traffic``, one window's plan replayed in each). By default (``--between drain``) each
window runs on its own, as vLLM's ``benchmark_serving`` runs each request rate: the budget is set
through the engine's control API (``PUT {url}/v1/scheduler`` with ``{"token_budget": N}``,
``Authorization: Bearer`` the control token when given), the window's requests are sent over
``window_s``, then arrivals stop and the sweep waits for every request to finish and for the
engine's running and waiting sets to empty (bounded by ``--window-drain-s``; a window that does
not drain is reported overloaded), so no window inherits the previous one's queue and a
prediction from the window's own traffic (which starts from an idle engine) describes the same
thing. ``--between continuous`` sends the traffic without a break and changes the budget live
(a window then starts with what the previous one left queued). A window runs from its first
possible arrival for ``window_s``; its first ``warmup_s`` seconds are discarded. Over the rest,
with loadgen's own definitions (loadgen/README.md) and percentiles (``loadgen.metrics.stats_ms``):

- ITL: every gap between consecutive output chunks of a request, counted in the window its
  later chunk arrived in, pooled over the ``chat`` class (over every class when there is no
  chat); p50, p99, max;
- TTFT: the requests whose first output chunk arrived in the window; p50 and p99 overall and by
  class;
- tokens/s: output chunks (one per token from chunkscope) that arrived in the window, divided by
  its measured length.

Predictions come side by side when given: ``--predictions FILE`` (the document ``python -m
advisor predict --out FILE`` writes) or ``--predict-db URL``, which runs the advisor in this
process on the traffic the store holds from before the sweep (imported only then: the advisor
drives the engine's scheduler, and the load generator otherwise never imports the engine).
The recommendation (``advisor.recommend``, plain Python) is made from the measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from advisor.overload import KEY as OVERLOAD_KEY
from advisor.overload import REASON_KEY as OVERLOAD_REASON_KEY
from advisor.overload import WindowLoad, judge
from advisor.pareto import front_budgets, front_pairs
from advisor.recommend import Slo as BudgetSlo
from advisor.recommend import recommend
from advisor.text import (
    DEFAULT_BUDGETS,
    WINDOW_COLUMNS,
    budget_table,
    parse_budgets,
    parse_caps,
)
from loadgen import __version__
from loadgen.arrivals import ARRIVALS
from loadgen.client import ClientConfig
from loadgen.metrics import stats_ms
from loadgen.options import TrafficOptions, id_range, non_negative, positive, setup
from loadgen.orchestrate import PlanError, plan
from loadgen.profiles import Profiles
from loadgen.record import RequestRecord
from loadgen.report import write_json
from loadgen.runner import execute, prefetch_images, probe_prompt_format, probe_server
from loadgen.spec import RequestSpec, reindex
from loadgen.tokens import Segment, TokenSource
from loadgen.traces import FORMATS
from loadgen.workload import PROFILES

logger = logging.getLogger(__name__)

ITL_CLASS = "chat"
PREDICTED_KEYS = (
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "itl_max_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokens_per_s",
)


class SweepError(RuntimeError):
    """The sweep cannot run (no control API, a budget refused, an unreadable prediction)."""


@dataclass
class Window:
    """One budget's (or (budget, cap) pair's) stretch of the run (wall seconds)."""

    budget: int
    start: float  # when the engine acknowledged the change
    end: float  # the next change (or the end of the traffic)
    applied_at_step: int | None = None
    changes: list[dict[str, Any]] = field(default_factory=list)
    cap: int | None = None  # long_prefill_token_threshold (None: not swept)
    # drained windows: {"drained", "drain_s", "requests_cut", "engine_busy"} (None: continuous)
    drain: dict[str, Any] | None = None


CAP_KEY = "long_prefill_token_threshold"


def sweep_pairs(budgets: Sequence[int], caps: Sequence[int] | None) -> list[tuple[int, int | None]]:
    """The windows' (budget, cap), budgets in the order given, each with every cap (None when
    caps are not swept); a cap at or above its budget cuts nothing, so it is left out there."""
    if caps is None:
        return [(int(b), None) for b in budgets]
    out: list[tuple[int, int | None]] = []
    for b in budgets:
        useful = [int(c) for c in caps if c == 0 or c < b]
        out += [(int(b), c) for c in (useful or [0])]
    return out


def _pair(w: Mapping[str, Any]) -> tuple[int, int]:
    return int(w["budget"]), int(w.get("cap") or 0)


# ---- figures ----------------------------------------------------------------------------------


def window_figures(
    records: Sequence[RequestRecord], lo: float, hi: float, itl_class: str = ITL_CLASS
) -> dict[str, Any]:
    """The figures of the chunks that arrived in [lo, hi) (wall seconds); keys as
    ``advisor.simulate.latency_figures``. A request's chunks count whatever its final status
    (a request cut at the end of the run still delivered them)."""
    ttft: dict[str, list[float]] = {}
    itl: dict[str, list[float]] = {}
    tokens = 0
    sent = errors = failed = 0
    for r in records:
        if r.send_wall is not None and lo <= r.send_wall < hi:
            sent += 1
            errors += r.status == "error" and not r.chunk_wall
            failed += failed_by(r, hi)
        cw = r.chunk_wall
        if not cw:
            continue
        if r.ttft_s is not None and lo <= cw[0] < hi:
            ttft.setdefault(r.traffic_class, []).append(r.ttft_s)
        gaps = itl.setdefault(r.traffic_class, [])
        for j, t in enumerate(cw):
            if lo <= t < hi:
                tokens += 1
                if j > 0 and j - 1 < len(r.itl_s):
                    gaps.append(r.itl_s[j - 1])
    pooled = itl.get(itl_class) or [g for v in itl.values() for g in v]
    itl_stats = stats_ms(pooled)
    ttft_stats = stats_ms([t for v in ttft.values() for t in v])
    length = hi - lo
    return {
        "itl_class": itl_class if itl.get(itl_class) else "all",
        "itl_p50_ms": itl_stats["p50"],
        "itl_p99_ms": itl_stats["p99"],
        "itl_p999_ms": float(np.percentile(np.asarray(pooled) * 1000.0, 99.9)) if pooled else None,
        "itl_max_ms": itl_stats["max"],
        "ttft_p50_ms": ttft_stats["p50"],
        "ttft_p99_ms": ttft_stats["p99"],
        "ttft_by_class": {
            cls: {"ttft_p50_ms": s["p50"], "ttft_p99_ms": s["p99"]}
            for cls, s in ((c, stats_ms(v)) for c, v in sorted(ttft.items()))
            if s["count"]
        },
        "num_ttft": ttft_stats["count"],
        "num_itl": itl_stats["count"],
        "output_tokens": tokens,
        "tokens_per_s": tokens / length if length > 0 else None,
        "requests_sent": sent,
        "requests_failed": errors,
        "requests_errored": failed,
        **window_load(records, lo, hi, failed).to_dict(),
    }


def failed_by(r: RequestRecord, hi: float) -> bool:
    """Whether the request failed (an error, a timeout) before ``hi``: one the load generator
    cancelled itself (the run's drain, ``cancelled: ...``) was cut, not failed."""
    if r.status != "error" or r.send_wall is None or (r.error or "").startswith("cancelled"):
        return False
    return r.e2e_s is None or r.send_wall + r.e2e_s <= hi


def window_load(records: Sequence[RequestRecord], lo: float, hi: float, failed: int) -> WindowLoad:
    """The window's load for ``advisor.overload``: a request is queued from its send to its
    first chunk (for ever when none came)."""
    sent = [r for r in records if r.send_wall is not None]
    firsts = [r.chunk_wall[0] if r.chunk_wall else None for r in sent]
    return judge([r.send_wall for r in sent], firsts, lo, hi, failed=failed)


def measured_windows(
    records: Sequence[RequestRecord], windows: Sequence[Window], warmup_s: float
) -> list[dict[str, Any]]:
    """One figures dict per window, over [start + warmup_s, end)."""
    out = []
    for w in windows:
        lo = min(w.start + warmup_s, w.end)
        fig = {
            "budget": w.budget,
            **({"cap": w.cap} if w.cap is not None else {}),
            "start": w.start,
            "end": w.end,
            "measured_from": lo,
            "measured_s": w.end - lo,
            "applied_at_step": w.applied_at_step,
            **window_figures(records, lo, w.end),
        }
        if w.drain is not None:
            fig["drain"] = dict(w.drain)
            if not w.drain.get("drained", True):
                fig[OVERLOAD_KEY] = True
                fig[OVERLOAD_REASON_KEY] = "; ".join(
                    x for x in (fig.get(OVERLOAD_REASON_KEY), undrained_reason(w.drain)) if x
                )
        out.append(fig)
    return out


def undrained_reason(drain: Mapping[str, Any]) -> str:
    """Why a drained window counts as overloaded: its requests outlived the drain bound."""
    parts = []
    if drain.get("requests_cut"):
        parts.append(f"{drain['requests_cut']} requests still unfinished at the drain bound")
    if drain.get("engine_busy"):
        parts.append(f"the engine still busy after it ({drain['engine_busy']})")
    return "it did not drain: " + (", ".join(parts) or "unknown")


def attach_predictions(
    windows: list[dict[str, Any]], predicted: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Add ``predicted_<figure>`` (and the relative error ``error_<figure>``) to each window
    whose budget (and cap: 0 when absent) was predicted."""
    by_pair = {_pair(p): p for p in predicted if "budget" in p}
    for w in windows:
        p = by_pair.get(_pair(w))
        if p is None:
            continue
        for key in PREDICTED_KEYS:
            w[f"predicted_{key}"] = p.get(key)
            m, q = w.get(key), p.get(key)
            w[f"error_{key}"] = (
                (q - m) / m if isinstance(m, int | float) and m and q is not None else None
            )
        w["predicted_ttft_by_class"] = p.get("ttft_by_class")
        w[f"predicted_{OVERLOAD_KEY}"] = bool(p.get(OVERLOAD_KEY))
        w[f"predicted_{OVERLOAD_REASON_KEY}"] = p.get(OVERLOAD_REASON_KEY)
    return windows


def predicted_windows(windows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The predicted figures of ``windows`` as windows of their own (for a recommendation)."""
    return [
        {
            "budget": w["budget"],
            **({"cap": w["cap"]} if "cap" in w else {}),
            **{k: w.get(f"predicted_{k}") for k in PREDICTED_KEYS},
            OVERLOAD_KEY: bool(w.get(f"predicted_{OVERLOAD_KEY}")),
            OVERLOAD_REASON_KEY: w.get(f"predicted_{OVERLOAD_REASON_KEY}"),
        }
        for w in windows
        if f"predicted_{PREDICTED_KEYS[0]}" in w
    ]


def repeat_plan(specs: Sequence[RequestSpec], n: int, window_s: float) -> list[RequestSpec]:
    """The plan of one window replayed in ``n`` windows: the same offsets (shifted), classes and
    lengths, with fresh token content and images in each window (segment keys and image
    variants renamed per window), so no window finds the previous one's prefixes cached."""
    out = []
    for k in range(n):
        for s in specs:
            out.append(
                replace(
                    s,
                    offset_s=s.offset_s + k * window_s,
                    segments=tuple(
                        Segment(f"{g.key}/w{k}", g.length, g.shared) for g in s.segments
                    ),
                    images=tuple(im._replace(variant=im.variant + 1000 * k) for im in s.images),
                    meta={**s.meta, "window": k},
                )
            )
    return reindex(out)


# ---- control ----------------------------------------------------------------------------------


def _control_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def get_scheduler(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with session.get(base + "/v1/scheduler") as r:
        if r.status != 200:
            raise SweepError(
                f"GET {base}/v1/scheduler answered http {r.status}: the sweep needs a server "
                "whose token budget can be changed live (chunkscope's control API)"
            )
        body = await r.json(content_type=None)
    if not isinstance(body, dict) or "token_budget" not in body:
        raise SweepError(f"GET {base}/v1/scheduler: unexpected answer {str(body)[:200]}")
    return body


async def set_budget(
    session: aiohttp.ClientSession,
    base: str,
    budget: int,
    token: str | None,
    cap: int | None = None,
) -> dict[str, Any]:
    """``PUT /v1/scheduler {"token_budget": budget}`` (and ``long_prefill_token_threshold``
    when ``cap`` is given); the engine's answer, or SweepError."""
    body_out: dict[str, int] = {"token_budget": int(budget)}
    if cap is not None:
        body_out[CAP_KEY] = int(cap)
    async with session.put(
        base + "/v1/scheduler",
        json=body_out,
        headers=_control_headers(token),
    ) as r:
        text = await r.text()
        if r.status != 200:
            raise SweepError(f"PUT /v1/scheduler {body_out}: http {r.status}: {text}")
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise SweepError(f"PUT /v1/scheduler: not JSON: {text[:200]}") from exc
    logger.info("token budget %d from step %s", budget, body.get("applied_at_step"))
    return body if isinstance(body, dict) else {}


def collector_scheduler(url: str, engine_id: str) -> dict[str, Any]:
    """What ``GET /v1/scheduler`` says, from a collector's engine list (for engines without that
    API, such as vLLM with the chunkscope bridge); SweepError when the engine is not connected."""
    from storage.control import list_engines  # the collector's client: only with --collector

    try:
        rows = list_engines(url)
    except (OSError, RuntimeError, TimeoutError) as exc:
        raise SweepError(f"collector {url}: {exc}") from exc
    row = next((r for r in rows if r.get("engine_id") == engine_id and r.get("connected")), None)
    if row is None:
        seen = sorted(str(r.get("engine_id")) for r in rows if r.get("connected"))
        raise SweepError(f"engine {engine_id!r} is not connected to {url} (connected: {seen})")
    out = {k: row.get(k) for k in ("token_budget", "max_token_budget", "policy")}
    if row.get(CAP_KEY) is not None:
        out[CAP_KEY] = row[CAP_KEY]
    return out


def collector_set_budget(
    url: str, engine_id: str, budget: int, token: str | None, cap: int | None = None
) -> dict[str, Any]:
    """The budget (and cap) through the collector's control relay; the ack, or SweepError."""
    from storage.control import send_control

    changes: dict[str, int] = {"token_budget": int(budget)}
    if cap is not None:
        changes[CAP_KEY] = int(cap)
    try:
        ack = send_control(url, engine_id, changes, token=token)
    except (OSError, RuntimeError, TimeoutError) as exc:
        raise SweepError(f"collector {url}: {exc}") from exc
    if not ack.get("ok"):
        raise SweepError(f"control {changes} for {engine_id} refused: {ack.get('error')}")
    logger.info("token budget %d from step %s (collector)", budget, ack.get("applied_at_step"))
    return ack


async def _get(control: aiohttp.ClientSession, base: str, args: argparse.Namespace) -> dict:
    if getattr(args, "collector", None):
        return await asyncio.to_thread(collector_scheduler, args.collector, args.engine)
    return await get_scheduler(control, base)


async def _set(
    control: aiohttp.ClientSession,
    base: str,
    args: argparse.Namespace,
    budget: int,
    cap: int | None = None,
) -> dict[str, Any]:
    if getattr(args, "collector", None):
        return await asyncio.to_thread(
            collector_set_budget, args.collector, args.engine, budget, args.control_token, cap
        )
    return await set_budget(control, base, budget, args.control_token, cap)


# ---- the run ----------------------------------------------------------------------------------


def _traffic(args: argparse.Namespace, total_s: float) -> TrafficOptions:
    """The sweep's traffic options for ``total_s`` seconds of traffic (no ramp, no count)."""
    return replace(TrafficOptions.from_args(args), duration=total_s, num_requests=None, ramp=0.0)


async def run_sweep(
    args: argparse.Namespace, profiles: Profiles, predicted: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """Drive the traffic, change the budget at each window, measure; the result document."""
    base = args.url.rstrip("/")
    budgets: list[int] = args.budgets
    caps: list[int] | None = getattr(args, "caps", None)
    pairs = sweep_pairs(budgets, caps)
    info = await probe_server(base, args.api_key)
    if not info.reachable:
        raise SweepError(f"server not reachable: {info.error}")
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as control:
        before = await _get(control, base, args)
        top = before.get("max_token_budget")
        if isinstance(top, int) and max(budgets) > top:
            raise SweepError(f"budget {max(budgets)} is above the server's maximum {top}")
        if caps is not None and CAP_KEY not in before:
            raise SweepError(
                f"GET {base}/v1/scheduler shows no {CAP_KEY}: this server cannot sweep caps"
            )
        ctx = args.max_model_len or info.max_model_len or 8192
        model = args.model or info.model or "default"
        total_s = len(pairs) * args.window_s
        try:
            if args.same_traffic:
                one, trace_info = plan(_traffic(args, args.window_s), profiles, ctx)
                specs = repeat_plan(one, len(pairs), args.window_s)
            else:
                specs, trace_info = plan(_traffic(args, total_s), profiles, ctx)
        except (ValueError, OSError) as exc:
            raise PlanError(str(exc)) from exc
        cfg = ClientConfig(
            base_url=base,
            model=model,
            ignore_eos=args.ignore_eos,
            request_timeout_s=args.request_timeout,
            api_key=args.api_key,
            vllm_xargs=info.owned_by == "vllm",
        )
        if args.prompt_format != "auto":
            cfg.prompt_format = args.prompt_format
        elif any(not s.is_chat for s in specs):
            cfg.prompt_format = await probe_prompt_format(cfg, token=args.token_id_range[0])
        await asyncio.to_thread(prefetch_images, specs)
        salt = args.prompt_salt if args.prompt_salt is not None else secrets.randbits(31)
        lo, hi = args.token_id_range
        tokens = TokenSource((args.seed * 1_000_003 + salt) & 0x7FFFFFFF, lo, hi)

        windows: list[Window] = []
        logger.info(
            "sweep: %d requests over %.0f s, (budget, cap) %s, %.0f s windows (%.0f s warm-up), %s",
            len(specs),
            total_s,
            pairs,
            args.window_s,
            args.warmup_s,
            "drained between windows" if args.between == "drain" else "continuous",
        )
        try:
            if args.between == "drain":
                records = await _drained_windows(
                    control, base, args, pairs, specs, cfg, tokens, windows
                )
            else:
                records = await _continuous_windows(
                    control, base, args, pairs, specs, cfg, tokens, windows
                )
        finally:
            final = args.apply_budget if args.apply_budget is not None else before["token_budget"]
            final_cap = None if caps is None else before.get(CAP_KEY)
            if final is not None:
                try:
                    await _set(control, base, args, int(final), final_cap)
                except (SweepError, aiohttp.ClientError, TimeoutError) as exc:
                    logger.warning("could not set the budget back to %s: %s", final, exc)

    measured = measured_windows(records, windows, args.warmup_s)
    if predicted:
        attach_predictions(measured, predicted)
    slo = slo_of(args)
    rec = recommend(measured, slo, "measured")
    doc: dict[str, Any] = {
        "tool": "chunkscope-loadgen-sweep",
        "version": __version__,
        "created": time.time(),
        "config": {
            **{k: v for k, v in vars(args).items() if k not in ("api_key", "control_token")},
            "prompt_salt": salt,
            "max_model_len_used": ctx,
            "model_used": model,
            "prompt_format_used": cfg.prompt_format,
            "profiles": profiles.as_dict(),
        },
        "server": {"url": base, "models": info.models, "scheduler_before": before},
        "trace": trace_info or None,
        "run": {
            "wall_start": windows[0].start,
            "wall_end": windows[-1].end,
            "requests": len(specs),
            "between_windows": args.between,
        },
        "slo": slo.to_dict(),
        "windows": measured,
        "overloaded_windows": [
            {"budget": w["budget"], "cap": w.get("cap"), "reason": w.get(OVERLOAD_REASON_KEY)}
            for w in measured
            if w.get(OVERLOAD_KEY)
        ],
        "pareto_budgets": front_budgets(measured),
        **({"pareto_pairs": front_pairs(measured)} if caps is not None else {}),
        "recommended_budget": rec.budget,
        **({"recommended_cap": rec.cap} if caps is not None else {}),
        "recommendation_source": rec.source,
        "reason": rec.reason,
        "recommendation": rec.to_dict(),
    }
    if predicted:
        prec = recommend(predicted_windows(measured), slo, "predicted")
        doc["predicted_recommendation"] = prec.to_dict()
        doc["predicted_pareto_budgets"] = front_budgets(predicted_windows(measured))
        doc["prediction_agrees"] = prec.chosen == rec.chosen
    doc["requests"] = [r.as_dict() for r in records]
    return doc


async def _continuous_windows(
    control: aiohttp.ClientSession,
    base: str,
    args: argparse.Namespace,
    pairs: Sequence[tuple[int, int | None]],
    specs: list[RequestSpec],
    cfg: ClientConfig,
    tokens: TokenSource,
    windows: list[Window],
) -> list[RequestRecord]:
    """One stream of traffic without a break, the setting changed live at each window: a
    window starts with whatever the previous one left queued (``--between continuous``)."""
    b0, c0 = pairs[0]
    first = await _set(control, base, args, b0, c0)
    t_start = time.time()
    windows.append(Window(b0, t_start, t_start, first.get("applied_at_step"), [first], c0))
    traffic = asyncio.create_task(
        execute(
            specs,
            cfg,
            tokens,
            max_concurrency=args.max_concurrency,
            drain_timeout_s=args.drain_s,
        )
    )
    try:
        for k, (budget, cap) in enumerate(pairs[1:], start=1):
            await _sleep_until(t_start + k * args.window_s, traffic)
            ack = await _set(control, base, args, budget, cap)
            now = time.time()
            windows[-1].end = now
            windows.append(Window(budget, now, now, ack.get("applied_at_step"), [ack], cap))
        await _sleep_until(t_start + len(pairs) * args.window_s, traffic)
        windows[-1].end = time.time()
        outcome = await traffic
    except BaseException:
        traffic.cancel()
        raise
    return outcome.records


def window_specs(specs: Sequence[RequestSpec], k: int, window_s: float) -> list[RequestSpec]:
    """The requests planned for window ``k`` (offsets in [k * window_s, (k + 1) * window_s)),
    their offsets made relative to the window's start."""
    lo, hi = k * window_s, (k + 1) * window_s
    return [replace(s, offset_s=s.offset_s - lo) for s in specs if lo <= s.offset_s < hi]


CUT_PREFIX = "cancelled: not finished within"


async def _drained_windows(
    control: aiohttp.ClientSession,
    base: str,
    args: argparse.Namespace,
    pairs: Sequence[tuple[int, int | None]],
    specs: list[RequestSpec],
    cfg: ClientConfig,
    tokens: TokenSource,
    windows: list[Window],
) -> list[RequestRecord]:
    """Each window on its own (``--between drain``, as vLLM's benchmark_serving runs each rate
    separately): set the budget, send the window's requests over ``window_s``, stop arrivals,
    wait for every request to finish (at most ``--window-drain-s``, then cancel the rest) and
    for the engine's running and waiting sets to empty; so every window starts from an idle
    engine, as a prediction from the window's own traffic does. A window that does not drain
    within the bound is reported overloaded (``Window.drain``)."""
    records: list[RequestRecord] = []
    for k, (budget, cap) in enumerate(pairs):
        ack = await _set(control, base, args, budget, cap)
        start = time.time()
        w = Window(budget, start, start + args.window_s, ack.get("applied_at_step"), [ack], cap)
        windows.append(w)
        mine = window_specs(specs, k, args.window_s)
        outcome = await execute(
            mine,
            cfg,
            tokens,
            max_concurrency=args.max_concurrency,
            drain_timeout_s=args.window_drain_s,
        )
        w.start = outcome.wall_start  # the requests' offsets count from here
        w.end = w.start + args.window_s
        records += outcome.records
        await asyncio.sleep(max(0.0, w.end - time.time()))  # a window lasts window_s at least
        cut = sum((r.error or "").startswith(CUT_PREFIX) for r in outcome.records)
        busy = await _wait_idle(control, base, args, bound_s=ENGINE_IDLE_S)
        w.drain = {
            "drained": cut == 0 and not busy,
            "drain_s": time.time() - w.end,
            "requests_cut": cut,
            "engine_busy": busy,
        }
        if not w.drain["drained"]:
            logger.warning("window %d (budget %d) did not drain: %s", k, budget, w.drain)
    return records


ENGINE_IDLE_S = 10.0  # after the client's last request ended, how long the engine may stay busy


async def _wait_idle(
    control: aiohttp.ClientSession, base: str, args: argparse.Namespace, bound_s: float
) -> dict[str, int] | None:
    """Poll the scheduler until it runs and queues nothing (a cancelled request is aborted
    shortly after its client goes): None when idle, else the last counts seen after
    ``bound_s``. An engine whose view lacks the counts (through a collector) counts as idle
    once the client's requests ended."""
    deadline = time.monotonic() + bound_s
    while True:
        view = await _get(control, base, args)
        counts = {k: view.get(k) for k in ("num_running", "num_waiting")}
        if not all(isinstance(v, int) for v in counts.values()):
            return None
        if not any(counts.values()):
            return None
        if time.monotonic() >= deadline:
            return counts  # type: ignore[return-value]
        await asyncio.sleep(0.2)


async def _sleep_until(wall: float, traffic: asyncio.Task[Any]) -> None:
    """Sleep until ``wall`` (time.time()); raise at once if the traffic task failed."""
    while True:
        left = wall - time.time()
        if left <= 0:
            return
        done, _ = await asyncio.wait({traffic}, timeout=min(left, 1.0))
        if done and traffic.exception() is not None:
            raise SweepError(f"the traffic stopped: {traffic.exception()!r}")


# ---- predictions ------------------------------------------------------------------------------


def load_predictions(path: str) -> list[dict[str, Any]]:
    """The ``windows`` of a prediction document (``python -m advisor predict --out``)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SweepError(f"--predictions {path}: {exc}") from exc
    windows = doc.get("windows") if isinstance(doc, dict) else None
    if not isinstance(windows, list) or not all(isinstance(w, dict) for w in windows):
        raise SweepError(f"--predictions {path}: no 'windows' list of objects")
    return windows


def predict_now(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the advisor on the store's traffic from before the sweep (lazy import)."""
    from advisor.predict import predict_from_store  # imports engine.core.scheduler: only when asked

    now = time.time()
    since = args.predict_since if args.predict_since is not None else now - args.predict_lookback_s
    until = args.predict_until if args.predict_until is not None else now
    doc = predict_from_store(
        args.predict_db,
        args.budgets,
        caps=getattr(args, "caps", None) or (0,),
        engine_id=args.predict_engine,
        since=since,
        until=until,
        slo=slo_of(args),
    )
    return list(doc["windows"])


def slo_of(args: argparse.Namespace) -> BudgetSlo:
    """The SLOs of the command line (p99 ITL and TTFT, the stall tail)."""
    return BudgetSlo(
        args.slo_itl_ms,
        args.slo_ttft_ms,
        getattr(args, "slo_itl_max_ms", None),
        getattr(args, "slo_itl_p999_ms", None),
    )


# ---- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen sweep",
        description="One window of traffic per token budget (PUT /v1/scheduler), the engine "
        "drained between windows (or, --between continuous, one stream changed live); "
        "measure ITL, TTFT and throughput per budget on the client, discard each window's "
        "warm-up, recommend a budget.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--profile", choices=PROFILES, default="mixed")
    p.add_argument("--rate", type=positive(float), help="total req/s (default: the profile's)")
    p.add_argument("--arrival", choices=ARRIVALS, help="arrival process for every class")
    p.add_argument("--burstiness", type=positive(float), help="gamma shape")
    p.add_argument("--trace", metavar="FILE", help="replay an Azure CSV or Mooncake JSONL trace")
    p.add_argument("--trace-format", choices=FORMATS, default="auto")
    p.add_argument("--time-scale", type=positive(float), default=1.0)
    p.add_argument("--trace-block-size", type=positive(int), default=512)
    p.add_argument("--budgets", type=parse_budgets, default=parse_budgets(DEFAULT_BUDGETS))
    p.add_argument(
        "--caps",
        type=parse_caps,
        default=None,
        help="long-prefill caps (long_prefill_token_threshold, 0 = off) to try beside each "
        "budget, e.g. 0,256: one window per (budget, cap); the recommendation is then a pair",
    )
    p.add_argument("--window-s", type=positive(float), default=60.0, help="seconds per window")
    p.add_argument(
        "--warmup-s",
        type=non_negative,
        default=15.0,
        help="seconds discarded at the start of each window",
    )
    p.add_argument(
        "--same-traffic",
        action="store_true",
        help="every window replays the traffic planned for the first (same arrivals and "
        "lengths, fresh prompt tokens): budgets compared on the same requests",
    )
    p.add_argument(
        "--between",
        choices=("drain", "continuous"),
        default="drain",
        help="drain (default): each window on its own, arrivals stopped and the engine "
        "drained before the next window (as vLLM's benchmark_serving runs each rate), so a "
        "window never inherits the previous one's queue; continuous: one stream without a "
        "break, the setting changed live",
    )
    p.add_argument(
        "--window-drain-s",
        type=positive(float),
        default=120.0,
        metavar="S",
        help="with --between drain: wait at most S after a window's last arrival for its "
        "requests to finish; the rest are cancelled and the window reported overloaded",
    )
    p.add_argument(
        "--collector",
        metavar="WS_URL",
        help="change the budget through this collector's control relay instead of the "
        "server's PUT /v1/scheduler (vLLM with the chunkscope bridge); needs --engine",
    )
    p.add_argument("--engine", metavar="ENGINE_ID", help="the engine id with --collector")
    p.add_argument("--slo-itl-ms", type=positive(float), help="SLO on the p99 ITL")
    p.add_argument("--slo-ttft-ms", type=positive(float), help="SLO on the p99 TTFT")
    p.add_argument(
        "--slo-itl-max-ms",
        type=positive(float),
        help="SLO on the longest inter-token gap (a stall that a p99 SLO cannot see)",
    )
    p.add_argument("--slo-itl-p999-ms", type=positive(float), help="SLO on the p99.9 ITL")
    p.add_argument("--out", metavar="FILE.json", help="write the sweep document here")
    p.add_argument("--control-token", default=os.environ.get("CHUNKSCOPE_CONTROL_TOKEN"))
    p.add_argument(
        "--apply-budget",
        type=positive(int),
        help="budget to leave the engine at (default: the one it had before the sweep)",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="leave the engine at the recommended budget (when one meets the SLOs)",
    )
    pred = p.add_mutually_exclusive_group()
    pred.add_argument("--predictions", metavar="FILE", help="`python -m advisor predict --out`")
    pred.add_argument("--predict-db", metavar="URL", help="predict now from this store")
    p.add_argument("--predict-engine", help="with --predict-db: the engine id")
    p.add_argument("--predict-since", type=float, help="with --predict-db: window start (wall s)")
    p.add_argument("--predict-until", type=float, help="with --predict-db: window end (wall s)")
    p.add_argument(
        "--predict-lookback-s",
        type=positive(float),
        default=600.0,
        help="with --predict-db and no --predict-since: the traffic of the last S seconds",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-salt", type=int)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="C.F=V")
    p.add_argument("--model")
    p.add_argument("--max-model-len", type=positive(int))
    p.add_argument("--max-concurrency", type=positive(int))
    p.add_argument("--token-id-range", type=id_range, default=(32, 126), metavar="LO,HI")
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--request-timeout", type=positive(float), default=600.0, metavar="S")
    p.add_argument(
        "--drain-s",
        type=positive(float),
        default=2.0,
        help="with --between continuous: after the last window, wait at most S for in-flight "
        "requests, then cancel them",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def table(doc: Mapping[str, Any]) -> str:
    cols = list(WINDOW_COLUMNS)
    if any("predicted_itl_p99_ms" in w for w in doc["windows"]):
        cols += ["predicted_itl_p99_ms", "predicted_ttft_p50_ms", "predicted_ttft_p99_ms"]
    lines = budget_table(doc["windows"], cols, doc["pareto_budgets"])
    lines.append(str(doc["reason"]))
    if "predicted_recommendation" in doc:
        lines.append(str(doc["predicted_recommendation"]["reason"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    profiles = setup(parser, args)
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url must start with http:// or https://, got {args.url!r}")
    if args.trace and not os.path.isfile(args.trace):
        parser.error(f"--trace: no such file: {args.trace}")
    if args.warmup_s >= args.window_s:
        parser.error("--warmup-s must be shorter than --window-s")
    if len(set(args.budgets)) != len(args.budgets):
        parser.error("--budgets must not repeat a budget")
    if args.apply and args.apply_budget is not None:
        parser.error("give --apply or --apply-budget, not both")
    if bool(args.collector) != bool(args.engine):
        parser.error("give --collector and --engine together (the engine to steer through it)")
    try:
        predicted: list[dict[str, Any]] | None = None
        if args.predictions:
            predicted = load_predictions(args.predictions)
        elif args.predict_db:
            predicted = predict_now(args)
        doc = asyncio.run(run_sweep(args, profiles, predicted))
        if args.apply and doc["recommended_budget"] is not None:
            cap = doc.get("recommended_cap")
            asyncio.run(_apply(args, int(doc["recommended_budget"]), cap))
            doc["applied_budget"] = doc["recommended_budget"]
            if cap is not None:
                doc["applied_cap"] = cap
    except PlanError as exc:
        parser.error(str(exc))
    except SweepError as exc:
        print(f"loadgen sweep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130
    if args.out:
        write_json(args.out, doc)
    print(table(doc))
    return 0


async def _apply(args: argparse.Namespace, budget: int, cap: int | None = None) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        await _set(s, args.url.rstrip("/"), args, budget, cap)
