"""Stalls: the token gaps of streams that lay across a long prefill, over one window.

A *long request* has an image or at least ``LONG_PROMPT_TOKENS`` prompt tokens (whatever its
traffic class). A *long-prefill step* ran a prefill chunk of one. A *stall* is a gap between two
consecutive tokens of a stream that held at least one long-prefill step: the stream waited for
that step. The budget bounds exactly these gaps, so a change is judged on them, beside the
ordinary percentiles. A gap counts in a window only when it lies wholly inside it, so a gap
that spans a budget change is in neither side.

::

    stream A   tok ─────────── gap (a stall) ───────────── tok
    steps      [decode] [ long prompt's chunk, 2,500 tok ] [decode]
                        └─ a long-prefill step inside the gap ─┘
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from storage import queries

logger = logging.getLogger(__name__)

LONG_PROMPT_TOKENS = 1024  # a prompt this long (or an image) is a long request
EDGE_S = 60.0  # gaps that end this long after a window (or began before it) are read for `met`
_EPS_S = 1e-6  # token times are step ends: the same clock, compared exactly up to float noise


@dataclass(frozen=True)
class StallWindow:
    """What one window held: its long requests, the stalls they caused, and the cost of
    chunking them (their TTFT). Times in milliseconds; None where the window held none."""

    lo: float
    hi: float
    traffic_class: str | None
    long_requests: int = 0  # long requests with a prefill chunk in the window
    long_met: int = 0  # of them, those whose prefill lay inside some stream's gap
    stalls: int = 0  # gaps (of the class) that held a long-prefill step
    stall_max_ms: float | None = None
    stall_p999_ms: float | None = None
    stall_p50_ms: float | None = None
    gaps: int = 0  # every gap of the class in the window
    gap_max_ms: float | None = None
    gap_p999_ms: float | None = None
    long_ttft_p50_ms: float | None = None  # long requests whose first token is in the window
    long_ttft_max_ms: float | None = None
    met_request_ids: tuple[str, ...] = field(default=(), repr=False)
    # per long request (by its first long-prefill step in the window): how many streams of the
    # class were in flight (arrived, not finished) when that step began
    in_flight: tuple[int, ...] = ()

    @property
    def met(self) -> bool:
        """The window holds a long prefill that stalled a stream: it can judge a budget."""
        return self.stalls > 0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["met_request_ids"] = list(self.met_request_ids)
        out["in_flight"] = list(self.in_flight)
        return out


def _ms(values: np.ndarray, q: float | None = None) -> float | None:
    if values.size == 0:
        return None
    return float(values.max() if q is None else np.quantile(values, q))


def long_mask(reqs: pd.DataFrame, min_prompt: int = LONG_PROMPT_TOKENS) -> pd.Series:
    """Which requests are long: an image, or at least ``min_prompt`` prompt tokens."""
    if reqs.empty:
        return pd.Series([], dtype=bool)
    images = pd.to_numeric(reqs["num_image_tokens"], errors="coerce").fillna(0) > 0
    prompt = pd.to_numeric(reqs["num_prompt_tokens"], errors="coerce").fillna(0)
    return images | (prompt >= min_prompt)


def stall_window(
    db: Engine,
    *,
    engine_id: str,
    run_id: str,
    since: float,
    until: float,
    traffic_class: str | None = "chat",
    min_prompt: int = LONG_PROMPT_TOKENS,
) -> StallWindow:
    """The stalls of one run's streams (of ``traffic_class``; None: every class) over the wall
    window [since, until]."""
    if not until > since:
        raise ValueError(f"need until > since, got {since} and {until}")
    since, until = float(since), float(until)
    empty = StallWindow(since, until, traffic_class)
    steps = queries.steps(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    reqs = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    edge = queries.token_itl(
        db,
        engine_id=engine_id,
        run_id=run_id,
        since=since - EDGE_S,  # by the step that made each token: read wide, then cut
        until=until + EDGE_S,
        traffic_class=traffic_class,
    )
    if not edge.empty:
        begin = edge["time"] - edge["itl_ms"] / 1000.0
        overlaps = (begin <= until + _EPS_S) & (edge["time"] >= since - _EPS_S)
        inside = (begin >= since - _EPS_S) & (edge["time"] <= until + _EPS_S)
        itl, edge = edge[inside], edge[overlaps]
    else:
        itl = edge
    gap_ms = itl["itl_ms"].to_numpy(dtype="float64") if not itl.empty else np.zeros(0)
    out: dict[str, Any] = {
        "gaps": int(gap_ms.size),
        "gap_max_ms": _ms(gap_ms),
        "gap_p999_ms": _ms(gap_ms, 0.999),
    }
    if steps.empty or reqs.empty:
        return StallWindow(since, until, traffic_class, **out) if gap_ms.size else empty
    long_reqs = reqs[long_mask(reqs, min_prompt)]
    if not long_reqs.empty:
        first = long_reqs["first_token"]
        done = long_reqs[(first >= since) & (first <= until)]["ttft_ms"].dropna().to_numpy()
        out["long_ttft_p50_ms"] = _ms(done, 0.5)
        out["long_ttft_max_ms"] = _ms(done)
    long_steps = _long_prefill_steps(db, engine_id, run_id, steps, set(long_reqs["request_id"]))
    out["long_requests"] = int(long_steps["request_id"].nunique()) if not long_steps.empty else 0
    out["in_flight"] = _in_flight(reqs, long_steps, traffic_class)
    if long_steps.empty or edge.empty:
        return StallWindow(since, until, traffic_class, **out)
    # steps run one after another: the long steps inside a gap are a contiguous run of them
    per_step = long_steps.drop_duplicates("step").sort_values("start")
    starts = per_step["start"].to_numpy(dtype="float64")
    ends = per_step["end"].to_numpy(dtype="float64")

    def held_steps(gaps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t_end = gaps["time"].to_numpy(dtype="float64")
        t_begin = t_end - gaps["itl_ms"].to_numpy(dtype="float64") / 1000.0
        first_in = np.searchsorted(starts, t_begin - _EPS_S, side="left")
        past = np.searchsorted(ends, t_end + _EPS_S, side="right")
        return past > first_in, first_in, past

    held = held_steps(itl)[0] if not itl.empty else np.zeros(0, dtype=bool)
    stall_ms = gap_ms[held]
    # met: the long requests a stream waited through, by every gap that overlaps the window (a
    # long prompt prefilled just before a cut stalled the gap that spans the cut, though that
    # gap is in neither side's figures)
    any_held, first_in, past = held_steps(edge)
    met: set[str] = set()
    if any_held.any():
        by_step = long_steps.groupby("step")["request_id"].agg(lambda s: set(s))
        step_nos = per_step["step"].to_numpy()
        for i, j in zip(first_in[any_held], past[any_held], strict=True):
            for no in step_nos[i:j]:
                met |= by_step[no]
    out.update(
        long_met=len(met),
        stalls=int(stall_ms.size),
        stall_max_ms=_ms(stall_ms),
        stall_p999_ms=_ms(stall_ms, 0.999),
        stall_p50_ms=_ms(stall_ms, 0.5),
        met_request_ids=tuple(sorted(met)),
    )
    return StallWindow(since, until, traffic_class, **out)


def _in_flight(
    reqs: pd.DataFrame, long_steps: pd.DataFrame, traffic_class: str | None
) -> tuple[int, ...]:
    """For each long request, the streams (of the class) in flight as its first long-prefill
    step of the window began."""
    if long_steps.empty:
        return ()
    streams = reqs if traffic_class is None else reqs[reqs["traffic_class"] == traffic_class]
    arrived = streams["arrival"].fillna(streams["first_scheduled"]).to_numpy(dtype="float64")
    finished = streams["finished"].fillna(np.inf).to_numpy(dtype="float64")
    ids = streams["request_id"].to_numpy()
    out = []
    for rid, t0 in long_steps.groupby("request_id")["start"].min().sort_values().items():
        live = (arrived <= t0) & (finished > t0) & (ids != rid)
        out.append(int(live.sum()))
    return tuple(out)


def _long_prefill_steps(
    db: Engine, engine_id: str, run_id: str, steps: pd.DataFrame, long_ids: set[str]
) -> pd.DataFrame:
    """(step, start, end, request_id) of every prefill chunk of a long request in ``steps``."""
    cols = ["step", "start", "end", "request_id"]
    with_prefill = steps[steps["num_prefill_tokens"] > 0]
    if with_prefill.empty or not long_ids:
        return pd.DataFrame(columns=cols)
    chunks = queries.step_chunks(
        db,
        engine_id=engine_id,
        run_id=run_id,
        step_from=int(with_prefill["step"].min()),
        step_to=int(with_prefill["step"].max()),
    )
    if chunks.empty:
        return pd.DataFrame(columns=cols)
    chunks = chunks[(chunks["kind"] == "prefill") & chunks["request_id"].isin(long_ids)]
    merged = chunks[["step", "request_id"]].merge(
        with_prefill[["step", "start", "end"]], on="step", how="inner"
    )
    return merged[cols]


def ratio(before: float | None, after: float | None) -> float | None:
    """before / after (how many times shorter), None when either is missing or after is 0."""
    if before is None or after is None or after <= 0:
        return None
    return before / after
