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

The column lists live in ``storage.columns``, the read plumbing (run anchors, windows, fetches)
in ``storage.reading``, ``latency_summary`` in ``storage.latency``; all are importable from here.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, Integer, and_, func, literal, or_, select

from storage import schema
from storage.columns import (
    CONTROLS_COLUMNS,
    ENGINES_COLUMNS,
    GAPS_COLUMNS,
    LATENCY_SUMMARY_COLUMNS,
    REQUESTS_COLUMNS,
    STEP_CHUNKS_COLUMNS,
    STEPS_COLUMNS,
    TOKEN_ITL_COLUMNS,
    TOKEN_TIMES_COLUMNS,
    empty,
)
from storage.latency import latency_summary
from storage.packing import (
    FLAG_CAPPED,
    FLAG_DECODE,
    FLAG_PRODUCED,
    unpack_chunks,
    unpack_tokens,
)
from storage.reading import (
    SLACK_NS,
    Run,
    concat_frames,
    fetch_rows,
    frame_of,
    has_cap_column,
    request_lookup,
    runs_of,
    token_records,
    window_conds,
)

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
                "engine_kind": _engine_kind(m["hello"]),
            }
        )
    return frame_of(out, ENGINES_COLUMNS)


def _engine_kind(hello: str | None) -> str | None:
    try:
        h = json.loads(hello) if hello else {}
    except ValueError:
        return None
    kind = h.get("engine_kind") if isinstance(h, dict) else None
    return kind if isinstance(kind, str) else None


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
    cols: list[Any] = [
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
            if has_cap_column(conn)
            else literal(None, Integer).label("long_prefill_token_threshold")
        )
        for run in runs_of(conn, engine_id, run_id):
            conds = [s.c.run_key == run.key]
            conds += window_conds(s.c.start_ns, *run.bounds(since, until))
            if after_step is not None:
                conds.append(s.c.step > after_step)
            q = select(*cols).where(*conds)
            if limit is not None:
                q = select(*cols).where(*conds).order_by(s.c.step.desc()).limit(int(limit))
            else:
                q = q.order_by(s.c.step)
            rows = fetch_rows(conn, q)
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
    return concat_frames(frames, STEPS_COLUMNS)


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
        for run in runs_of(conn, engine_id, run_id):
            rows = fetch_rows(
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
            ids, classes = request_lookup(conn, run.key, chunks["req"].astype(np.int64))
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
    return concat_frames(frames, STEP_CHUNKS_COLUMNS)


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
        for run in runs_of(conn, engine_id, run_id):
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
    return concat_frames(frames, REQUESTS_COLUMNS)


def _ns_col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name].astype("float64")


def _request_frame(run: Run, df: pd.DataFrame) -> pd.DataFrame:
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
        for run in runs_of(conn, engine_id, run_id):
            after_ns = run.to_ns(after_time, SLACK_NS)
            tokens, end_ns, step_no = token_records(conn, run, *run.bounds(since, until), after_ns)
            keep = tokens["k"] >= 2
            if after_ns is not None:
                keep &= end_ns > after_ns
            if not keep.any():
                continue
            tokens, end_ns, step_no = tokens[keep], end_ns[keep], step_no[keep]
            ids, classes = request_lookup(conn, run.key, tokens["req"].astype(np.int64))
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
    out = concat_frames(frames, TOKEN_ITL_COLUMNS)
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
        for run in reversed(runs_of(conn, engine_id, run_id)):
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
    return empty(TOKEN_TIMES_COLUMNS)


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
    conds += window_conds(c.c.wall, since, until)
    with db.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(c).where(*conds).order_by(c.c.wall))]
        if not rows:
            return empty(CONTROLS_COLUMNS)
        runs = {(r.engine_id, r.run_id): r for r in runs_of(conn, engine_id, run_id)}
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
    df = frame_of(out, CONTROLS_COLUMNS)
    for name in ("old_value", "new_value"):  # ints and strings as they were sent
        df[name] = pd.Series([m[name] for m in out], dtype=object)
    return df


def _none(_constant: str) -> None:
    return None


def _json(text: str | None) -> Any:
    """A stored JSON value; NaN and infinities (not JSON, so never exported) read as None."""
    if text is None:
        return None
    try:
        value = json.loads(text, parse_constant=_none)
    except ValueError:
        return text
    if isinstance(value, float) and value - value != 0.0:
        return None  # a number too large for a float
    return value


def gaps(db: Engine, *, engine_id: str | None = None, run_id: str | None = None) -> pd.DataFrame:
    """Telemetry that was lost, oldest first: the engine's ``gap`` events (what it could not
    keep), and events the collector received but could not store (a gap of one at the event's
    own seq, its reason saying why)."""
    g = schema.gaps
    out = []
    with db.connect() as conn:
        for run in runs_of(conn, engine_id, run_id):
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
    return frame_of(out, GAPS_COLUMNS)


__all__ = [
    "CONTROLS_COLUMNS",
    "ENGINES_COLUMNS",
    "GAPS_COLUMNS",
    "LATENCY_SUMMARY_COLUMNS",
    "REQUESTS_COLUMNS",
    "STEP_CHUNKS_COLUMNS",
    "STEPS_COLUMNS",
    "TOKEN_ITL_COLUMNS",
    "TOKEN_TIMES_COLUMNS",
    "controls",
    "engines",
    "gaps",
    "latency_summary",
    "requests",
    "step_chunks",
    "steps",
    "token_itl",
    "token_times",
]
