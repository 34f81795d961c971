"""The reads the dashboard needs. Each is a plain function taking a SQLAlchemy ``Engine``
(``storage.db.connect(url, readonly=True)``) and keyword filters, returning a pandas DataFrame;
an empty DataFrame still has its columns.

Conventions:

- Filters: ``engine_id`` / ``run_id`` (None = all), ``since`` / ``until`` (wall-clock seconds
  since the epoch, inclusive; None = open). A wall-clock window is turned into each run's
  monotonic nanoseconds through that run's clock anchor, so every query is an index range
  scan on (run_key, time).
- ``*_ns`` columns are the engine's raw monotonic integers; ``start``, ``end``, ``time``,
  ``arrival``... are wall-clock float seconds derived through the run's anchor; durations are
  float milliseconds.
- Chunk layouts and token times are packed per step (``storage.packing``) and unpacked here for
  the selected steps only.
- A missing traffic class is reported as ``"unknown"`` in ``latency_summary``, None elsewhere.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, Integer, and_, func, inspect, literal, or_, select

from storage import schema
from storage.packing import (
    FLAG_CAPPED,
    FLAG_DECODE,
    FLAG_PRODUCED,
    unpack_chunks,
    unpack_tokens,
)

ENGINES_COLUMNS = [
    "engine_id",
    "run_id",
    "model",
    "host",
    "pid",
    "started",
    "ended",
    "ended_without_goodbye",
    "connected",
    "last_step",
    "last_time",
    "token_budget",
    "max_token_budget",
    "policy",
    "num_steps",
    "num_gap_events",
    "config",
]
STEPS_COLUMNS = [
    "engine_id",
    "run_id",
    "step",
    "start",
    "end",
    "start_ns",
    "end_ns",
    "duration_ms",
    "forward_ms",
    "token_budget",
    "policy",
    "num_decode_tokens",
    "num_prefill_tokens",
    "num_scheduled_tokens",
    "num_running",
    "num_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "num_preemptions",
    "num_chunks",
    "long_prefill_token_threshold",
]
STEP_CHUNKS_COLUMNS = [
    "engine_id",
    "run_id",
    "step",
    "idx",
    "request_id",
    "kind",
    "start",
    "num_tokens",
    "produced_token",
    "traffic_class",
    "capped",
]
REQUESTS_COLUMNS = [
    "engine_id",
    "run_id",
    "request_id",
    "traffic_class",
    "num_prompt_tokens",
    "num_image_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "arrival",
    "first_scheduled",
    "first_token",
    "finished",
    "finish_reason",
    "ttft_ms",
    "tpot_ms",
    "max_itl_ms",
    "e2e_ms",
]
TOKEN_ITL_COLUMNS = [
    "engine_id",
    "run_id",
    "request_id",
    "traffic_class",
    "k",
    "time",
    "itl_ms",
    "step",
]
TOKEN_TIMES_COLUMNS = ["k", "time", "step", "time_ns"]
LATENCY_SUMMARY_COLUMNS = [
    "traffic_class",
    "num_requests",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "itl_max_ms",
    "num_gaps",
    "output_tokens",
    "tokens_per_s",
]
CONTROLS_COLUMNS = [
    "engine_id",
    "run_id",
    "time",
    "time_ns",
    "key",
    "old_value",
    "new_value",
    "accepted",
    "source",
    "applied_at_step",
    "applied_at",
    "reason",
    "request_id",
]
GAPS_COLUMNS = [
    "engine_id",
    "run_id",
    "seq",
    "first_seq_lost",
    "last_seq_lost",
    "num_events_lost",
    "reason",
    "time",
]

# Window bounds are widened by this much so that a time read back from a query (a float of
# wall seconds) selects its own row again.
_SLACK_NS = 1_000
# Steps longer than this are not expected; it bounds the index scan of ``after_time``.
_MAX_STEP_NS = 60 * 10**9


class _Run:
    __slots__ = ("key", "engine_id", "run_id", "wall_ns", "mono_ns", "started")

    def __init__(self, m: Any) -> None:
        self.key = int(m["id"])
        self.engine_id = m["engine_id"]
        self.run_id = m["run_id"]
        self.wall_ns = int(m["clock_wall_ns"])
        self.mono_ns = int(m["clock_mono_ns"])
        self.started = m["started"]

    def to_ns(self, wall_s: float | None, slack_ns: int = 0) -> int | None:
        """Monotonic ns of a wall time, moved by ``slack_ns`` (float seconds since the epoch
        carry about 0.25 us, so window bounds are widened by ``_SLACK_NS``)."""
        if wall_s is None:
            return None
        return self.mono_ns + round(float(wall_s) * 1e9) - self.wall_ns + slack_ns

    def bounds(self, since: float | None, until: float | None) -> tuple[int | None, int | None]:
        return self.to_ns(since, -_SLACK_NS), self.to_ns(until, _SLACK_NS)

    def wall(self, t_ns: Any) -> Any:
        """Wall seconds of monotonic ns (scalar, array or Series; None/NaN stay missing)."""
        if t_ns is None:
            return None
        return (t_ns - self.mono_ns + self.wall_ns) / 1e9


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})


def _runs(conn: Any, engine_id: str | None, run_id: str | None) -> list[_Run]:
    r = schema.runs
    q = select(r.c.id, r.c.engine_id, r.c.run_id, r.c.clock_wall_ns, r.c.clock_mono_ns, r.c.started)
    if engine_id is not None:
        q = q.where(r.c.engine_id == engine_id)
    if run_id is not None:
        q = q.where(r.c.run_id == run_id)
    return [_Run(row._mapping) for row in conn.execute(q.order_by(r.c.started, r.c.id))]


def _has_cap_column(conn: Any) -> bool:
    """Whether ``steps`` has revision 0002's ``long_prefill_token_threshold``."""
    return any(
        c["name"] == "long_prefill_token_threshold" for c in inspect(conn).get_columns("steps")
    )


def _fetch(conn: Any, stmt: Any) -> list[tuple[Any, ...]]:
    """All rows of ``stmt`` as plain tuples, through the driver's cursor: for the wide reads
    (thousands of rows with packed columns) SQLAlchemy's result rows cost more than the SQL."""
    compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    params = compiled.construct_params()
    args: Any = (
        tuple(params[name] for name in compiled.positiontup)
        if compiled.positional and compiled.positiontup is not None
        else params
    )
    cursor = conn.connection.cursor()
    try:
        cursor.execute(str(compiled), args)
        return cursor.fetchall()
    finally:
        cursor.close()


def _window(col: Any, lo: int | None, hi: int | None) -> list[Any]:
    conds = []
    if lo is not None:
        conds.append(col >= lo)
    if hi is not None:
        conds.append(col <= hi)
    return conds


def _frame(rows: list[dict[str, Any]] | pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    if isinstance(rows, pd.DataFrame):
        df = rows
    else:
        df = pd.DataFrame(rows)
    if df.empty:
        return _empty(columns)
    return df[columns].reset_index(drop=True)


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    if not frames:
        return _empty(columns)
    if len(frames) == 1:
        return frames[0][columns].reset_index(drop=True)
    return pd.concat(frames, ignore_index=True)[columns]


def _request_lookup(conn: Any, run_key: int, req_nos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Arrays mapping req_no -> request_id and req_no -> traffic_class for ``req_nos``."""
    if req_nos.size == 0:
        return np.empty(0, dtype=object), np.empty(0, dtype=object)
    lo, hi = int(req_nos.min()), int(req_nos.max())
    q = schema.requests
    ids = np.full(hi - lo + 1, None, dtype=object)
    classes = np.full(hi - lo + 1, None, dtype=object)
    for req_no, request_id, traffic_class in conn.execute(
        select(q.c.req_no, q.c.request_id, q.c.traffic_class).where(
            q.c.run_key == run_key, q.c.req_no >= lo, q.c.req_no <= hi
        )
    ):
        ids[req_no - lo] = request_id
        classes[req_no - lo] = traffic_class
    idx = req_nos - lo
    return ids[idx], classes[idx]


# ---- engines and runs -------------------------------------------------------------------------


def engines(db: Engine) -> pd.DataFrame:
    """One row per run, newest first: who reported, its configuration and where it stands."""
    r = schema.runs
    with db.connect() as conn:
        rows = [dict(row._mapping) for row in conn.execute(select(r).order_by(r.c.started.desc()))]
    out = []
    for m in rows:
        end_ns = m["last_step_end_ns"]
        out.append(
            {
                "engine_id": m["engine_id"],
                "run_id": m["run_id"],
                "model": m["model"],
                "host": m["host"],
                "pid": m["pid"],
                "started": m["started"],
                "ended": m["ended"],
                "ended_without_goodbye": bool(m["ended_without_goodbye"]),
                "connected": bool(m["connected"]),
                "last_step": m["last_step"],
                "last_time": None
                if end_ns is None
                else (m["clock_wall_ns"] + end_ns - m["clock_mono_ns"]) / 1e9,
                "token_budget": m["token_budget"],
                "max_token_budget": m["max_token_budget"],
                "policy": m["policy"],
                "num_steps": m["num_steps"],
                "num_gap_events": m["num_gap_events"],
                "config": m["config"],
            }
        )
    return _frame(out, ENGINES_COLUMNS)


# ---- steps ------------------------------------------------------------------------------------


def steps(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    after_step: int | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    """Steps whose start is in [since, until], ordered by (run, step).

    ``after_step`` keeps only steps numbered above it (the Live page reads only new rows);
    ``limit`` keeps the newest ``limit`` rows of each run (still returned in step order).
    """
    s = schema.steps
    cols = [
        s.c.step,
        s.c.start_ns,
        s.c.end_ns,
        s.c.forward_ns,
        s.c.token_budget,
        s.c.policy,
        s.c.num_decode_tokens,
        s.c.num_prefill_tokens,
        s.c.num_scheduled_tokens,
        s.c.num_running,
        s.c.num_waiting,
        s.c.kv_blocks_used,
        s.c.kv_blocks_total,
        s.c.num_preemptions,
        s.c.num_chunks,
    ]
    frames = []
    with db.connect() as conn:
        # a store not yet migrated to revision 0002 (read-only readers never migrate): NULL
        cols.append(
            s.c.long_prefill_token_threshold
            if _has_cap_column(conn)
            else literal(None, Integer).label("long_prefill_token_threshold")
        )
        for run in _runs(conn, engine_id, run_id):
            conds = [s.c.run_key == run.key]
            conds += _window(s.c.start_ns, *run.bounds(since, until))
            if after_step is not None:
                conds.append(s.c.step > after_step)
            q = select(*cols).where(*conds)
            if limit is not None:
                q = select(*cols).where(*conds).order_by(s.c.step.desc()).limit(int(limit))
            else:
                q = q.order_by(s.c.step)
            rows = _fetch(conn, q)
            if not rows:
                continue
            df = pd.DataFrame(rows, columns=[c.name for c in cols])
            if limit is not None:
                df = df.iloc[::-1]
            df["engine_id"] = run.engine_id
            df["run_id"] = run.run_id
            df["start"] = run.wall(df["start_ns"])
            df["end"] = run.wall(df["end_ns"])
            df["duration_ms"] = (df["end_ns"] - df["start_ns"]) / 1e6
            df["forward_ms"] = df["forward_ns"].astype("float64") / 1e6
            frames.append(df)
    return _concat(frames, STEPS_COLUMNS)


def step_chunks(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    step_from: int,
    step_to: int,
) -> pd.DataFrame:
    """The chunk layout of steps ``step_from``..``step_to`` (inclusive): one row per chunk in
    scheduling order (``idx`` from 0 within its step); ``start`` is the chunk's first position."""
    s = schema.steps
    frames = []
    with db.connect() as conn:
        for run in _runs(conn, engine_id, run_id):
            rows = _fetch(
                conn,
                select(s.c.step, s.c.num_chunks, s.c.chunks)
                .where(s.c.run_key == run.key, s.c.step >= step_from, s.c.step <= step_to)
                .order_by(s.c.step),
            )
            if not rows:
                continue
            counts = np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows))
            chunks = unpack_chunks([r[2] for r in rows])
            if chunks.size == 0:
                continue
            step_no = np.repeat(np.fromiter((r[0] for r in rows), dtype=np.int64), counts)
            starts = np.repeat(np.cumsum(counts) - counts, counts)
            idx = np.arange(chunks.size) - starts
            ids, classes = _request_lookup(conn, run.key, chunks["req"].astype(np.int64))
            flags = chunks["flags"]
            frames.append(
                pd.DataFrame(
                    {
                        "engine_id": run.engine_id,
                        "run_id": run.run_id,
                        "step": step_no,
                        "idx": idx,
                        "request_id": ids,
                        "kind": np.where(flags & FLAG_DECODE, "decode", "prefill"),
                        "start": chunks["start"].astype(np.int64),
                        "num_tokens": chunks["n"].astype(np.int64),
                        "produced_token": (flags & FLAG_PRODUCED).astype(bool),
                        "traffic_class": classes,
                        "capped": (flags & FLAG_CAPPED).astype(bool),
                    }
                )
            )
    return _concat(frames, STEP_CHUNKS_COLUMNS)


# ---- requests and tokens ----------------------------------------------------------------------


def requests(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    traffic_class: str | None = None,
) -> pd.DataFrame:
    """One row per request whose lifetime overlaps [since, until] (arrived by ``until`` and not
    finished before ``since``), by arrival. TTFT and TPOT use the exact token times."""
    q = schema.requests
    frames = []
    with db.connect() as conn:
        for run in _runs(conn, engine_id, run_id):
            lo, hi = run.bounds(since, until)
            conds = [q.c.run_key == run.key]
            begin = func.coalesce(q.c.arrival_ns, q.c.first_scheduled_ns, q.c.first_token_ns)
            if hi is not None:
                conds.append(begin <= hi)
            if lo is not None:
                conds.append(or_(q.c.finished_ns.is_(None), q.c.finished_ns >= lo))
            if traffic_class is not None:
                conds.append(q.c.traffic_class == traffic_class)
            rows = conn.execute(select(q).where(and_(*conds)).order_by(begin, q.c.req_no)).all()
            if not rows:
                continue
            df = pd.DataFrame([r._mapping for r in rows])
            frames.append(_request_frame(run, df))
    return _concat(frames, REQUESTS_COLUMNS)


def _ns_col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name].astype("float64")


def _request_frame(run: _Run, df: pd.DataFrame) -> pd.DataFrame:
    arrival = _ns_col(df, "arrival_ns")
    first = _ns_col(df, "first_token_ns")
    last = _ns_col(df, "last_token_ns")
    finished = _ns_col(df, "finished_ns")
    n = df["num_tokens"].astype("float64")
    out = pd.DataFrame(
        {
            "engine_id": run.engine_id,
            "run_id": run.run_id,
            "request_id": df["request_id"],
            "traffic_class": df["traffic_class"],
            "num_prompt_tokens": df["num_prompt_tokens"],
            "num_image_tokens": df["num_image_tokens"],
            "num_cached_tokens": df["num_cached_tokens"],
            "num_output_tokens": np.maximum(df["num_output_tokens"], df["num_tokens"]),
            "arrival": run.wall(arrival),
            "first_scheduled": run.wall(_ns_col(df, "first_scheduled_ns")),
            "first_token": run.wall(first),
            "finished": run.wall(finished),
            "finish_reason": df["finish_reason"],
            "ttft_ms": (first - arrival) / 1e6,
            "tpot_ms": ((last - first) / (n - 1)).where(n >= 2) / 1e6,
            "max_itl_ms": _ns_col(df, "max_itl_ns") / 1e6,
            "e2e_ms": (finished - arrival) / 1e6,
        }
    )
    return out


def _token_records(
    conn: Any, run: _Run, lo: int | None, hi: int | None, after_ns: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, end_ns per token, step per token) of the steps starting in [lo, hi]."""
    s = schema.steps
    conds = [s.c.run_key == run.key, s.c.num_tokens_out > 0]
    conds += _window(s.c.start_ns, lo, hi)
    if after_ns is not None:
        conds += [s.c.start_ns >= after_ns - _MAX_STEP_NS, s.c.end_ns > after_ns]
    rows = _fetch(
        conn,
        select(s.c.step, s.c.end_ns, s.c.num_tokens_out, s.c.tokens)
        .where(*conds)
        .order_by(s.c.start_ns),
    )
    if not rows:
        empty = np.empty(0, dtype=np.int64)
        return unpack_tokens([]), empty, empty
    counts = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
    tokens = unpack_tokens([r[3] for r in rows])
    end_ns = np.repeat(np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows)), counts)
    step_no = np.repeat(np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)), counts)
    return tokens, end_ns, step_no


def token_itl(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    traffic_class: str | None = None,
    after_time: float | None = None,
) -> pd.DataFrame:
    """One row per token k >= 2 produced by a step starting in [since, until] (and, with
    ``after_time``, at a time after it): ``itl_ms`` = time of token k - time of token k-1."""
    frames = []
    with db.connect() as conn:
        for run in _runs(conn, engine_id, run_id):
            after_ns = run.to_ns(after_time, _SLACK_NS)
            tokens, end_ns, step_no = _token_records(conn, run, *run.bounds(since, until), after_ns)
            keep = tokens["k"] >= 2
            if after_ns is not None:
                keep &= end_ns > after_ns
            if not keep.any():
                continue
            tokens, end_ns, step_no = tokens[keep], end_ns[keep], step_no[keep]
            ids, classes = _request_lookup(conn, run.key, tokens["req"].astype(np.int64))
            df = pd.DataFrame(
                {
                    "engine_id": run.engine_id,
                    "run_id": run.run_id,
                    "request_id": ids,
                    "traffic_class": classes,
                    "k": tokens["k"].astype(np.int64),
                    "time": run.wall(end_ns),
                    "itl_ms": tokens["itl_ns"] / 1e6,
                    "step": step_no,
                }
            )
            if traffic_class is not None:
                df = df[df["traffic_class"] == traffic_class]
            frames.append(df)
    out = _concat(frames, TOKEN_ITL_COLUMNS)
    if len(frames) > 1:
        out = out.sort_values("time", kind="stable", ignore_index=True)
    return out


def token_times(
    db: Engine, *, engine_id: str | None = None, run_id: str | None = None, request_id: str
) -> pd.DataFrame:
    """Every token time of one request (its newest run when several runs have that id)."""
    q = schema.requests
    s = schema.steps
    with db.connect() as conn:
        for run in reversed(_runs(conn, engine_id, run_id)):
            row = conn.execute(
                select(q.c.req_no, q.c.first_token_step, q.c.last_token_step).where(
                    q.c.run_key == run.key, q.c.request_id == request_id
                )
            ).first()
            if row is None or row[1] is None:
                continue
            req_no, first_step, last_step = row
            rows = conn.execute(
                select(s.c.step, s.c.end_ns, s.c.num_tokens_out, s.c.tokens)
                .where(
                    s.c.run_key == run.key,
                    s.c.step >= first_step,
                    s.c.step <= last_step,
                    s.c.num_tokens_out > 0,
                )
                .order_by(s.c.step)
            ).all()
            counts = np.fromiter((r[2] for r in rows), dtype=np.int64, count=len(rows))
            tokens = unpack_tokens([r[3] for r in rows])
            end_ns = np.repeat(np.fromiter((r[1] for r in rows), dtype=np.int64), counts)
            step_no = np.repeat(np.fromiter((r[0] for r in rows), dtype=np.int64), counts)
            mine = tokens["req"] == req_no
            df = pd.DataFrame(
                {
                    "k": tokens["k"][mine].astype(np.int64),
                    "time": run.wall(end_ns[mine]),
                    "step": step_no[mine],
                    "time_ns": end_ns[mine],
                }
            )
            return df.sort_values("k", ignore_index=True)
    return _empty(TOKEN_TIMES_COLUMNS)


# ---- summaries --------------------------------------------------------------------------------


def _codes(classes: list[Any], code_of: Any) -> np.ndarray:
    """Class codes of a list of class names (None included), one dict lookup each."""
    mapping = {c: code_of(c) for c in set(classes)}
    return np.fromiter((mapping[c] for c in classes), dtype=np.int64, count=len(classes))


def _pcts(values: np.ndarray, qs: list[float]) -> list[float | None]:
    values = values[~np.isnan(values)]
    if not values.size:
        return [None] * len(qs)
    return [float(v) for v in np.percentile(values, qs)]


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
    q = schema.requests
    s = schema.steps
    g = schema.gaps
    names: dict[str, int] = {}  # class name -> code
    itl_codes: list[np.ndarray] = []
    itl_vals: list[np.ndarray] = []
    tok_codes: list[np.ndarray] = []
    req_frames: list[pd.DataFrame] = []
    num_gaps = 0
    span_lo: float | None = None
    span_hi: float | None = None

    def code_of(cls: Any) -> int:
        name = "unknown" if cls is None or (isinstance(cls, float) and np.isnan(cls)) else str(cls)
        return names.setdefault(name, len(names))

    with db.connect() as conn:
        for run in _runs(conn, engine_id, run_id):
            lo, hi = run.bounds(since, until)
            tokens, _, _ = _token_records(conn, run, lo, hi)
            req_lo: int | None = None
            if tokens.size:
                req = tokens["req"].astype(np.int64)
                r_lo, r_hi = int(req.min()), int(req.max())
                codes = np.zeros(r_hi - r_lo + 1, dtype=np.int64)
                codes[:] = code_of(None)
                found = _fetch(
                    conn,
                    select(q.c.req_no, q.c.traffic_class).where(
                        q.c.run_key == run.key, q.c.req_no >= r_lo, q.c.req_no <= r_hi
                    ),
                )
                if found:
                    nos = np.fromiter((r[0] for r in found), dtype=np.int64, count=len(found))
                    codes[nos - r_lo] = _codes([r[1] for r in found], code_of)
                token_codes = codes[req - r_lo]
                tok_codes.append(token_codes)
                later = tokens["k"] >= 2
                itl_codes.append(token_codes[later])
                itl_vals.append(tokens["itl_ns"][later] / 1e6)
                req_lo = r_lo
            # Requests are numbered in order of arrival, so the ones that matter (a token in
            # the window, or arrived in it) form a short range of req_no: the window's tokens'
            # numbers widened to the first and last arrival in the window.
            req_hi = int(tokens["req"].max()) if tokens.size else None
            if lo is not None or hi is not None:
                in_window = [q.c.run_key == run.key, *_window(q.c.arrival_ns, lo, hi)]
                for order in (q.c.arrival_ns, q.c.arrival_ns.desc()):
                    found = conn.execute(
                        select(q.c.req_no).where(*in_window).order_by(order).limit(1)
                    ).scalar()
                    if found is not None:
                        req_lo = found if req_lo is None else min(req_lo, found)
                        req_hi = found if req_hi is None else max(req_hi, found)
            if lo is None and hi is None:
                req_lo, req_hi = 0, None
            if req_lo is not None:
                conds = [q.c.run_key == run.key, q.c.req_no >= req_lo]
                if req_hi is not None:
                    conds.append(q.c.req_no <= req_hi)
                rows = _fetch(
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
                req_frames.append(
                    pd.DataFrame(
                        {
                            "code": _codes([r[0] for r in rows], code_of),
                            "ttft_ms": ttft.where(in_first),
                            "tpot_ms": tpot.where(in_fin & (n >= 2)),
                            "finished": in_fin,
                        }
                    )
                )
            gap_conds = [g.c.run_key == run.key]
            if since is not None:
                gap_conds.append(g.c.wall >= since)
            if until is not None:
                gap_conds.append(g.c.wall <= until)
            num_gaps += int(conn.execute(select(func.count()).where(*gap_conds)).scalar() or 0)
            if since is None or until is None:
                bounds = conn.execute(
                    select(func.min(s.c.start_ns), func.max(s.c.end_ns)).where(
                        s.c.run_key == run.key, *_window(s.c.start_ns, lo, hi)
                    )
                ).first()
                if bounds is not None and bounds[0] is not None:
                    b_lo, b_hi = run.wall(bounds[0]), run.wall(bounds[1])
                    span_lo = b_lo if span_lo is None else min(span_lo, b_lo)
                    span_hi = b_hi if span_hi is None else max(span_hi, b_hi)
    if not tok_codes and not req_frames:
        return _empty(LATENCY_SUMMARY_COLUMNS)
    lo_s = since if since is not None else span_lo
    hi_s = until if until is not None else span_hi
    window_s = (hi_s - lo_s) if lo_s is not None and hi_s is not None else None
    all_tok = np.concatenate(tok_codes) if tok_codes else np.empty(0, dtype=np.int64)
    all_itl_c = np.concatenate(itl_codes) if itl_codes else np.empty(0, dtype=np.int64)
    all_itl = np.concatenate(itl_vals) if itl_vals else np.empty(0)
    reqs = pd.concat(req_frames, ignore_index=True) if req_frames else None
    used = set(np.unique(all_tok).tolist())
    if reqs is not None:
        used |= set(reqs["code"].unique().tolist())
    by_name = sorted((name, code) for name, code in names.items() if code in used)
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
                "num_gaps": num_gaps,
                "output_tokens": n_out,
                "tokens_per_s": n_out / window_s if window_s else None,
            }
        )
    return _frame(out, LATENCY_SUMMARY_COLUMNS)


def _in(values: pd.Series, lo: int | None, hi: int | None) -> pd.Series:
    ok = values.notna()
    if lo is not None:
        ok &= values >= lo
    if hi is not None:
        ok &= values <= hi
    return ok


# ---- controls and gaps ------------------------------------------------------------------------


def controls(
    db: Engine,
    *,
    engine_id: str | None = None,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> pd.DataFrame:
    """Budget and policy changes, accepted and refused, oldest first. ``applied_at`` is the wall
    time of the start of ``applied_at_step`` (None until that step has run)."""
    c = schema.controls
    s = schema.steps
    conds = []
    if engine_id is not None:
        conds.append(c.c.engine_id == engine_id)
    if run_id is not None:
        conds.append(c.c.run_id == run_id)
    conds += _window(c.c.wall, since, until)
    with db.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(c).where(*conds).order_by(c.c.wall))]
        if not rows:
            return _empty(CONTROLS_COLUMNS)
        runs = {(r.engine_id, r.run_id): r for r in _runs(conn, engine_id, run_id)}
        out = []
        for m in rows:
            run = runs.get((m["engine_id"], m["run_id"]))
            applied_at = None
            if run is not None and m["applied_at_step"] is not None:
                start_ns = conn.execute(
                    select(s.c.start_ns).where(
                        s.c.run_key == run.key, s.c.step == m["applied_at_step"]
                    )
                ).scalar()
                applied_at = run.wall(start_ns)
            out.append(
                {
                    "engine_id": m["engine_id"],
                    "run_id": m["run_id"],
                    "time": m["wall"],
                    "time_ns": m["time_ns"],
                    "key": m["key"],
                    "old_value": _json(m["old_value"]),
                    "new_value": _json(m["new_value"]),
                    "accepted": bool(m["accepted"]),
                    "source": m["source"],
                    "applied_at_step": m["applied_at_step"],
                    "applied_at": applied_at,
                    "reason": m["reason"],
                    "request_id": m["request_id"],
                }
            )
    df = _frame(out, CONTROLS_COLUMNS)
    for name in ("old_value", "new_value"):  # ints and strings as they were sent
        df[name] = pd.Series([m[name] for m in out], dtype=object)
    return df


def _json(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def gaps(db: Engine, *, engine_id: str | None = None, run_id: str | None = None) -> pd.DataFrame:
    """Telemetry the engine could not keep (its ``gap`` events), oldest first."""
    g = schema.gaps
    out = []
    with db.connect() as conn:
        for run in _runs(conn, engine_id, run_id):
            for row in conn.execute(select(g).where(g.c.run_key == run.key).order_by(g.c.seq)):
                m = row._mapping
                out.append(
                    {
                        "engine_id": run.engine_id,
                        "run_id": run.run_id,
                        "seq": m["seq"],
                        "first_seq_lost": m["first_seq_lost"],
                        "last_seq_lost": m["last_seq_lost"],
                        "num_events_lost": m["num_events_lost"],
                        "reason": m["reason"],
                        "time": m["wall"],
                    }
                )
    return _frame(out, GAPS_COLUMNS)
