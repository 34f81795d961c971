"""One load test end to end from parsed CLI options: probe, plan, run, summarise, report."""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
import time
from typing import Any

from loadgen import __version__
from loadgen.client import ClientConfig
from loadgen.metrics import Slo, summarize_all
from loadgen.options import TrafficOptions
from loadgen.profiles import Profiles
from loadgen.progress import Progress
from loadgen.report import table, write_json
from loadgen.runner import execute, prefetch_images, probe_prompt_format, probe_server
from loadgen.shapes import background_rate, background_users, resolve, shaped_profiles
from loadgen.spec import RequestSpec
from loadgen.tokens import TokenSource
from loadgen.traces import load_trace, trace_specs
from loadgen.workload import ChatUsers, PlanOptions, build_plan

logger = logging.getLogger(__name__)


class PlanError(ValueError):
    """The options describe no valid plan (reported as a usage error)."""


def plan(
    traffic: TrafficOptions, profiles: Profiles, ctx: int, background: float = 0.0
) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The requests of a run (a trace replayed, or a profile's traffic) and, for a trace, what
    was read from it; ``ctx``: the server's context length; ``background``: req/s of chat
    streams beside the profile's own requests."""
    if traffic.trace:
        limit = traffic.num_requests
        trace = load_trace(
            traffic.trace, traffic.trace_format or "auto", traffic.time_scale, limit=limit
        )
        specs = trace_specs(
            trace,
            ctx,
            block_size=traffic.trace_block_size,
            duration=traffic.duration,
            num_requests=traffic.num_requests,
        )
        return specs, {
            "format": trace.fmt,
            "rows": len(trace.rows),
            "skipped_rows": trace.skipped,
            "skip_reasons": trace.skip_reasons,
        }
    opts = PlanOptions(
        profile=traffic.profile,
        rate=traffic.rate,
        arrival=traffic.arrival,
        burstiness=traffic.burstiness,
        ramp_s=traffic.ramp,
        ramp_from=traffic.ramp_from,
        duration=traffic.duration,
        num_requests=traffic.num_requests,
        seed=traffic.seed,
        max_model_len=ctx,
        background_chat=background,
    )
    return build_plan(profiles, opts), {}


async def run_from_args(args: argparse.Namespace, profiles: Profiles) -> tuple[int, str]:
    """Probe the server, plan, run, summarise, write the JSON: (exit status, summary table)."""
    base = args.url.rstrip("/")
    info = await probe_server(base, args.api_key)
    if info.error:
        logger.warning("server probe: %s", info.error)
    ctx = args.max_model_len or info.max_model_len or 8192
    model = args.model or info.model or "default"
    asked = getattr(args, "shapes", "realistic")
    shapes = resolve(asked, info.model)
    if shapes != asked and shapes != "realistic":  # auto: main() validated the realistic set
        try:
            profiles = shaped_profiles(shapes, args.overrides)
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    background = background_rate(
        args.profile, getattr(args, "chat_background", None), profiles, trace=bool(args.trace)
    )
    n_users = background_users(
        args.profile, getattr(args, "chat_users", None), profiles, trace=bool(args.trace)
    )
    if shapes != "realistic" or background or n_users:
        print(
            f"loadgen: shapes {shapes} (server model {info.model}); "
            f"chat users {n_users} (think {profiles.chat.think_s:g} s); "
            f"chat background {background:g} req/s",
            file=sys.stderr,
        )
    try:
        specs, trace_info = plan(TrafficOptions.from_args(args), profiles, ctx, background)
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
    needs_ids = any(not s.is_chat for s in specs)
    if args.prompt_format != "auto":
        cfg.prompt_format = args.prompt_format
    elif needs_ids and info.reachable:
        cfg.prompt_format = await probe_prompt_format(cfg, token=args.token_id_range[0])
    n_img = await asyncio.to_thread(prefetch_images, specs)
    salt = args.prompt_salt if args.prompt_salt is not None else secrets.randbits(31)
    lo, hi = args.token_id_range
    tokens = TokenSource((args.seed * 1_000_003 + salt) & 0x7FFFFFFF, lo, hi)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    logger.info("running %d requests (%d distinct images) against %s", len(specs), n_img, base)
    outcome = await execute(
        specs,
        cfg,
        tokens,
        max_concurrency=args.max_concurrency,
        drain_timeout_s=args.drain_timeout,
        progress=Progress(len(specs), enabled=show),
        users=ChatUsers(
            profiles.chat,
            n_users,
            seed=args.seed,
            max_model_len=ctx,
            until_s=args.duration,
        )
        if n_users
        else None,
    )
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    summary = summarize_all(outcome.records, slo)
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    config.update(
        prompt_salt=salt,
        max_model_len_used=ctx,
        model_used=model,
        prompt_format_used=cfg.prompt_format,
        shapes_used=shapes,
        chat_background_rate=background,
        chat_users=n_users,
        profiles=profiles.as_dict(),
    )
    result = {
        "tool": "chunkscope-loadgen",
        "version": __version__,
        "created": time.time(),
        "config": config,
        "server": {
            "url": base,
            "reachable": info.reachable,
            "models": info.models,
            "max_model_len": info.max_model_len,
            "probe_error": info.error,
        },
        "trace": trace_info or None,
        "run": {
            "wall_start": outcome.wall_start,
            "wall_end": outcome.wall_end,
            "duration_s": outcome.duration_s,
        },
        "summary": summary,
        "warnings": outcome.warnings,
        "requests": [r.as_dict() for r in outcome.records],
    }
    if args.out:
        write_json(args.out, result)
    return (0 if summary["overall"]["ok"] > 0 or not specs else 1), table(summary)
