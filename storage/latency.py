"""``latency_summary``: latency percentiles by traffic class over a window (re-exported by
``storage.queries``, where the dashboard reads it). No torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, func, select

from storage import schema
from storage.columns import (
    LATENCY_SUMMARY_COLUMNS,
    empty,
)
from storage.reading import Run, fetch_rows, frame_of, runs_of, token_records, window_conds

# Window bounds are widened by this much so that a time read back from a query (a float of


# ---- summaries --------------------------------------------------------------------------------


class _Classes:
    """Traffic class names as small integer codes (a missing class is ``unknown``)."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}  # class name -> code

    def code_of(self, cls: Any) -> int:
        name = "unknown" if cls is None or (isinstance(cls, float) and np.isnan(cls)) else str(cls)
        return self.names.setdefault(name, len(self.names))

    def codes(self, classes: list[Any]) -> np.ndarray:
        """Class codes of a list of class names (None included), one dict lookup each."""
        mapping = {c: self.code_of(c) for c in set(classes)}
        return np.fromiter((mapping[c] for c in classes), dtype=np.int64, count=len(classes))


@dataclass
class _Gathered:
    """What the runs of a window contribute, before the percentiles."""

    itl_codes: list[np.ndarray] = field(default_factory=list)
    itl_vals: list[np.ndarray] = field(default_factory=list)
    tok_codes: list[np.ndarray] = field(default_factory=list)
    req_frames: list[pd.DataFrame] = field(default_factory=list)
    num_gaps: int = 0
    span_lo: float | None = None
    span_hi: float | None = None


def _pcts(values: np.ndarray, qs: list[float]) -> list[float | None]:
    values = values[~np.isnan(values)]
    if not values.size:
        return [None] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]


def _in(values: pd.Series, lo: int | None, hi: int | None) -> pd.Series:
    ok = values.notna()
    if lo is not None:
        ok &= values >= lo
    if hi is not None:
        ok &= values <= hi
    return ok


def latency_summary(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> pd.DataFrame:
    """Latency percentiles by traffic class over a window, plus a row ``traffic_class="all"``.

    ITL over every token k >= 2 produced by a step starting in the window; ``output_tokens``
    counts the tokens produced in it and ``tokens_per_s`` divides them by the window (or, when
    it is open, by the span of its steps). TTFT over requests whose first token is in the
    window; TPOT over requests finished in it with two tokens or more; ``num_requests`` counts
    the requests finished in the window (among those that produced a token or arrived in it).
    ``num_gaps`` is the number of telemetry ``gap`` events in the window (the same on every
    row: lost events belong to no class).
    """
    classes = _Classes()
    got = _Gathered()
    with db.connect() as conn:
        for run in runs_of(conn, engine_id, run_id):
            _gather_run(conn, run, since, until, classes, got)
    if not got.tok_codes and not got.req_frames:
        return empty(LATENCY_SUMMARY_COLUMNS)
    lo_s = since if since is not None else got.span_lo
    hi_s = until if until is not None else got.span_hi
    window_s = (hi_s - lo_s) if lo_s is not None and hi_s is not None else None
    return frame_of(_rows(got, classes, window_s), LATENCY_SUMMARY_COLUMNS)


def _gather_run(
    conn: Any,
    run: Run,
    since: float | None,
    until: float | None,
    classes: _Classes,
    got: _Gathered,
) -> None:
    """One run's tokens, requests, gap events and (for an open window) step span."""
    lo, hi = run.bounds(since, until)
    tokens, _, _ = token_records(conn, run, lo, hi)
    req_lo = _gather_tokens(conn, run, tokens, classes, got)
    # Requests are numbered in order of arrival, so the ones that matter (a token in
    # the window, or arrived in it) form a short range of req_no: the window's tokens'
    # numbers widened to the first and last arrival in the window.
    req_hi = int(tokens["req"].max()) if tokens.size else None
    if lo is not None or hi is not None:
        req_lo, req_hi = _widen_to_arrivals(conn, run, lo, hi, req_lo, req_hi)
    if lo is None and hi is None:
        req_lo, req_hi = 0, None
    if req_lo is not None:
        got.req_frames.append(_requests_part(conn, run, lo, hi, req_lo, req_hi, classes))
    got.num_gaps += _num_gaps(conn, run, since, until)
    if since is None or until is None:
        _widen_span(conn, run, lo, hi, got)


def _gather_tokens(
    conn: Any, run: Run, tokens: np.ndarray, classes: _Classes, got: _Gathered
) -> int | None:
    """Class codes of the window's tokens and the ITLs of tokens k >= 2; the lowest req_no."""
    if not tokens.size:
        return None
    q = schema.requests
    req = tokens["req"].astype(np.int64)
    r_lo, r_hi = int(req.min()), int(req.max())
    codes = np.zeros(r_hi - r_lo + 1, dtype=np.int64)
    codes[:] = classes.code_of(None)
    found = fetch_rows(
        conn,
        select(q.c.req_no, q.c.traffic_class).where(
            q.c.run_key == run.key, q.c.req_no >= r_lo, q.c.req_no <= r_hi
        ),
    )
    if found:
        nos = np.fromiter((r[0] for r in found), dtype=np.int64, count=len(found))
        codes[nos - r_lo] = classes.codes([r[1] for r in found])
    token_codes = codes[req - r_lo]
    got.tok_codes.append(token_codes)
    later = tokens["k"] >= 2
    got.itl_codes.append(token_codes[later])
    got.itl_vals.append(tokens["itl_ns"][later] / 1e6)
    return r_lo


def _widen_to_arrivals(
    conn: Any, run: Run, lo: int | None, hi: int | None, req_lo: int | None, req_hi: int | None
) -> tuple[int | None, int | None]:
    """The req_no range widened to the first and last request that arrived in [lo, hi]."""
    q = schema.requests
    in_window = [q.c.run_key == run.key, *window_conds(q.c.arrival_ns, lo, hi)]
    for order in (q.c.arrival_ns, q.c.arrival_ns.desc()):
        found = conn.execute(select(q.c.req_no).where(*in_window).order_by(order).limit(1)).scalar()
        if found is not None:
            req_lo = found if req_lo is None else min(req_lo, found)
            req_hi = found if req_hi is None else max(req_hi, found)
    return req_lo, req_hi


def _requests_part(
    conn: Any,
    run: Run,
    lo: int | None,
    hi: int | None,
    req_lo: int,
    req_hi: int | None,
    classes: _Classes,
) -> pd.DataFrame:
    """TTFT (first token in the window), TPOT (finished in it, two tokens or more) and whether
    it finished in the window, per request of the req_no range, with its class code."""
    q = schema.requests
    conds = [q.c.run_key == run.key, q.c.req_no >= req_lo]
    if req_hi is not None:
        conds.append(q.c.req_no <= req_hi)
    rows = fetch_rows(
        conn,
        select(
            q.c.traffic_class,
            q.c.arrival_ns,
            q.c.first_token_ns,
            q.c.last_token_ns,
            q.c.finished_ns,
            q.c.num_tokens,
        ).where(*conds),
    )
    df = pd.DataFrame(
        rows,
        columns=[
            "traffic_class",
            "arrival_ns",
            "first_token_ns",
            "last_token_ns",
            "finished_ns",
            "num_tokens",
        ],
    )
    first = df["first_token_ns"].astype("float64")
    fin = df["finished_ns"].astype("float64")
    in_first = _in(first, lo, hi)
    in_fin = _in(fin, lo, hi)
    n = df["num_tokens"].astype("float64")
    ttft = (first - df["arrival_ns"].astype("float64")) / 1e6
    tpot = (df["last_token_ns"].astype("float64") - first) / (n - 1) / 1e6
    return pd.DataFrame(
        {
            "code": classes.codes([r[0] for r in rows]),
            "ttft_ms": ttft.where(in_first),
            "tpot_ms": tpot.where(in_fin & (n >= 2)),
            "finished": in_fin,
        }
    )


def _num_gaps(conn: Any, run: Run, since: float | None, until: float | None) -> int:
    g = schema.gaps
    gap_conds = [g.c.run_key == run.key]
    if since is not None:
        gap_conds.append(g.c.wall >= since)
    if until is not None:
        gap_conds.append(g.c.wall <= until)
    return int(conn.execute(select(func.count()).where(*gap_conds)).scalar() or 0)


def _widen_span(conn: Any, run: Run, lo: int | None, hi: int | None, got: _Gathered) -> None:
    """Widen the span of the steps seen (wall seconds) by this run's steps in [lo, hi]."""
    s = schema.steps
    bounds = conn.execute(
        select(func.min(s.c.start_ns), func.max(s.c.end_ns)).where(
            s.c.run_key == run.key, *window_conds(s.c.start_ns, lo, hi)
        )
    ).first()
    if bounds is not None and bounds[0] is not None:
        b_lo, b_hi = run.wall(bounds[0]), run.wall(bounds[1])
        got.span_lo = b_lo if got.span_lo is None else min(got.span_lo, b_lo)
        got.span_hi = b_hi if got.span_hi is None else max(got.span_hi, b_hi)


def _rows(got: _Gathered, classes: _Classes, window_s: float | None) -> list[dict[str, Any]]:
    """One row per class seen (by name), then ``all``."""
    all_tok = np.concatenate(got.tok_codes) if got.tok_codes else np.empty(0, dtype=np.int64)
    all_itl_c = np.concatenate(got.itl_codes) if got.itl_codes else np.empty(0, dtype=np.int64)
    all_itl = np.concatenate(got.itl_vals) if got.itl_vals else np.empty(0)
    reqs = pd.concat(got.req_frames, ignore_index=True) if got.req_frames else None
    used = set(np.unique(all_tok).tolist())
    if reqs is not None:
        used |= set(reqs["code"].unique().tolist())
    by_name = sorted((name, code) for name, code in classes.names.items() if code in used)
    out = []
    for name, code in [*by_name, ("all", None)]:
        itl = all_itl if code is None else all_itl[all_itl_c == code]
        n_out = int(all_tok.size if code is None else np.count_nonzero(all_tok == code))
        r = reqs if reqs is None or code is None else reqs[reqs["code"] == code]
        ttft = r["ttft_ms"].to_numpy(dtype=np.float64) if r is not None else np.empty(0)
        tpot = r["tpot_ms"].to_numpy(dtype=np.float64) if r is not None else np.empty(0)
        ttft50, ttft99 = _pcts(ttft, [50, 99])
        tpot50, tpot99 = _pcts(tpot, [50, 99])
        itl50, itl99, itl999 = _pcts(itl, [50, 99, 99.9])
        out.append(
            {
                "traffic_class": name,
                "num_requests": int(r["finished"].sum()) if r is not None else 0,
                "ttft_p50_ms": ttft50,
                "ttft_p99_ms": ttft99,
                "tpot_p50_ms": tpot50,
                "tpot_p99_ms": tpot99,
                "itl_p50_ms": itl50,
                "itl_p99_ms": itl99,
                "itl_p999_ms": itl999,
                "itl_max_ms": float(itl.max()) if itl.size else None,
                "num_gaps": got.num_gaps,
                "output_tokens": n_out,
                "tokens_per_s": n_out / window_s if window_s else None,
            }
        )
    return out
