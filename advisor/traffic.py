"""The traffic observed in a window, read from the store, and turned into simulator input.

A request's arrival, traffic class, prompt length (image placeholder tokens included), image
tokens, cached prompt tokens and output length come from ``storage.queries.requests``. The store
keeps no token ids, so :func:`to_sim_requests` writes synthetic prompts that reproduce the
observed prefix-cache hits: a request that had ``c`` cached tokens starts with the first ``c``
tokens of an earlier request of its class (one that had the same number cached, i.e. most likely
the same shared document or system prompt, else the latest one long enough); every other token
is unique to its request. A shared prefix whose first use predates the window is pre-cached.
The engine's shape (KV blocks, block size, sequence cap, context, policy, prefix caching) comes
from the run's hello and its steps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from advisor.overload import WindowLoad, judge
from advisor.simulate import UNKNOWN_MODEL_LEN, EngineShape, SimRequest
from storage import queries

logger = logging.getLogger(__name__)

_TOKEN_STRIDE = 1 << 24  # request i's own tokens are i * stride + position: never shared


@dataclass(frozen=True)
class ObservedRequest:
    request_id: str
    traffic_class: str | None
    arrival: float  # wall seconds
    num_prompt_tokens: int
    num_image_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    # prompt tokens the engine had computed (cached ones included) when the window began: a
    # request it was still prefilling then (``advisor.autopilot_run.prefill_progress``)
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class Traffic:
    """Requests that arrived in [since, until] (wall seconds) and produced a token."""

    requests: list[ObservedRequest]
    since: float
    until: float

    @property
    def duration_s(self) -> float:
        return max(self.until - self.since, 1e-9)

    def summary(self) -> dict[str, Any]:
        """Counts, rates and length percentiles, overall and by class."""
        out: dict[str, Any] = {
            "since": self.since,
            "until": self.until,
            "duration_s": self.duration_s,
            "classes": {},
        }
        groups: dict[str, list[ObservedRequest]] = {"all": list(self.requests)}
        for r in self.requests:
            groups.setdefault(r.traffic_class or "unknown", []).append(r)
        for name, reqs in groups.items():
            prompt = np.array([r.num_prompt_tokens for r in reqs], dtype=float)
            output = np.array([r.num_output_tokens for r in reqs], dtype=float)
            cached = np.array([r.num_cached_tokens for r in reqs], dtype=float)
            images = np.array([r.num_image_tokens for r in reqs], dtype=float)

            def pct(a: np.ndarray, q: float) -> float | None:
                return float(np.percentile(a, q)) if a.size else None

            out["classes"][name] = {
                "num_requests": len(reqs),
                "rate_per_s": len(reqs) / self.duration_s,
                "prompt_tokens_p50": pct(prompt, 50),
                "prompt_tokens_p90": pct(prompt, 90),
                "image_tokens_mean": float(images.mean()) if images.size else None,
                "cached_tokens_mean": float(cached.mean()) if cached.size else None,
                "output_tokens_p50": pct(output, 50),
                "output_tokens_p90": pct(output, 90),
            }
        return out


def observed_traffic(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> Traffic:
    """Requests that arrived in the window (and produced at least one token), by arrival."""
    df = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    if not df.empty:
        df = df[df["arrival"].notna()]
        if since is not None:
            df = df[df["arrival"] >= since]
        if until is not None:
            df = df[df["arrival"] <= until]
        df = df[df["num_output_tokens"].fillna(0) > 0].sort_values("arrival", kind="stable")
    reqs = [
        ObservedRequest(
            request_id=str(r.request_id),
            traffic_class=None if pd.isna(r.traffic_class) else str(r.traffic_class),
            arrival=float(r.arrival),
            num_prompt_tokens=int(r.num_prompt_tokens),
            num_image_tokens=int(r.num_image_tokens or 0),
            num_cached_tokens=int(r.num_cached_tokens or 0),
            num_output_tokens=int(r.num_output_tokens),
        )
        for r in df.itertuples(index=False)
    ]
    lo = since if since is not None else (reqs[0].arrival if reqs else 0.0)
    hi = until if until is not None else (reqs[-1].arrival if reqs else lo)
    logger.info("traffic: %d requests in [%.3f, %.3f]", len(reqs), lo, hi)
    return Traffic(reqs, float(lo), float(hi))


FINISHED_OK = ("stop", "length")


def observed_load(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> WindowLoad | None:
    """The stored window's load for ``advisor.overload`` (None without a window or requests): a
    request is queued from its arrival to its first token; one that finished any other way than
    stop or length (aborted: the client gave up or timed out) counts as failed."""
    df = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    if df.empty:
        return None
    df = df[df["arrival"].notna()]
    lo = since if since is not None else float(df["arrival"].min())
    hi = until if until is not None else float(df["arrival"].max())
    if hi <= lo:
        return None
    firsts = [None if pd.isna(f) else float(f) for f in df["first_token"]]
    reason = df["finish_reason"]
    arrived = (df["arrival"] >= lo) & (df["arrival"] < hi)
    failed = int((arrived & reason.notna() & ~reason.isin(FINISHED_OK)).sum())
    return judge([float(a) for a in df["arrival"]], firsts, lo, hi, failed=failed)


def to_sim_requests(
    traffic: Traffic, block_size: int
) -> tuple[list[SimRequest], list[tuple[int, ...]]]:
    """Simulator requests (arrivals in ns from ``traffic.since``) with synthetic prompts that
    share prefixes as the observed cache hits say, and the prefixes to pre-cache (those whose
    first use predates the window)."""
    out: list[SimRequest] = []
    warm: list[tuple[int, ...]] = []
    prompts: list[list[int]] = []
    for i, r in enumerate(traffic.requests):
        n = max(1, r.num_prompt_tokens)
        own = [i * _TOKEN_STRIDE + p for p in range(n)]
        cached = min(r.num_cached_tokens, n - 1)
        cached -= cached % block_size
        if cached > 0:
            donor = _donor(traffic.requests, prompts, i, cached)
            if donor is None:  # first use before the window: this request's prefix, pre-cached
                warm.append(tuple(own[:cached]))
            else:
                own[:cached] = prompts[donor][:cached]
        # prefilled before the window began: its own computed prefix is in the KV cache
        computed = min(r.num_computed_tokens, n - 1)
        computed -= computed % block_size
        if computed > cached:
            warm.append(tuple(own[:computed]))
        prompts.append(own)
        out.append(
            SimRequest(
                request_id=r.request_id,
                arrival_ns=max(0, round((r.arrival - traffic.since) * 1e9)),
                prompt_token_ids=tuple(own),
                num_output_tokens=max(1, r.num_output_tokens),
                traffic_class=r.traffic_class,
            )
        )
    return out, warm


def _donor(
    reqs: list[ObservedRequest], prompts: list[list[int]], i: int, cached: int
) -> int | None:
    """The earlier request whose prefix request ``i`` most likely reused."""
    cls = reqs[i].traffic_class
    fallback = None
    for j in range(i - 1, -1, -1):
        rj = reqs[j]
        if rj.traffic_class != cls or len(prompts[j]) <= cached:
            continue
        if rj.num_cached_tokens == reqs[i].num_cached_tokens:
            return j
        if fallback is None:
            fallback = j
    return fallback


def engine_shape(
    db: Engine, *, engine_id: str | None = None, run_id: str | None = None
) -> EngineShape:
    """The scheduler-relevant configuration of the newest selected run."""
    runs = queries.engines(db)
    if engine_id is not None:
        runs = runs[runs["engine_id"] == engine_id]
    if run_id is not None:
        runs = runs[runs["run_id"] == run_id]
    if runs.empty:
        raise ValueError("no run in the store matches the selection")
    row = runs.iloc[0]
    try:
        config = json.loads(row["config"]) if isinstance(row["config"], str) else {}
    except ValueError:
        config = {}
    last = queries.steps(db, engine_id=row["engine_id"], run_id=row["run_id"], limit=1)
    blocks = int(last["kv_blocks_total"].iloc[0]) if not last.empty else None
    if blocks is None:
        blocks = int(config.get("num_kv_blocks") or 1 << 20)
    return EngineShape(
        # a vLLM engine (the bridge's hello says so) is replayed with vLLM v1's order
        scheduler="vllm" if row.get("engine_kind") == "vllm" else "chunkscope",
        num_kv_blocks=blocks,
        block_size=int(config.get("block_size") or 16),
        max_num_seqs=int(config.get("max_num_seqs") or 256),
        max_model_len=int(config.get("max_model_len") or UNKNOWN_MODEL_LEN),
        max_token_budget=int(row["max_token_budget"] or config.get("max_token_budget") or 8192),
        policy=str(row["policy"] or config.get("policy") or "chunked"),
        enable_prefix_caching=bool(config.get("enable_prefix_caching", True)),
    )


def shape_dict(shape: EngineShape) -> dict[str, Any]:
    return asdict(shape)
