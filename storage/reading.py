"""How ``storage.queries`` reads the store: a run's clock anchor (wall seconds <-> the engine's
monotonic ns), the runs a filter selects, window conditions, the driver-level fetch for wide
reads, frames with their columns, and the packed token records of a window's steps. No torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import inspect, select

from storage import schema
from storage.columns import (
    empty,
)
from storage.packing import (
    unpack_tokens,
)

# Window bounds are widened by this much so that a time read back from a query (a float of
# wall seconds) selects its own row again.
SLACK_NS = 1_000
# Steps longer than this are not expected; it bounds the index scan of ``after_time``.
MAX_STEP_NS = 60 * 10**9


class Run:
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
        carry about 0.25 us, so window bounds are widened by ``SLACK_NS``)."""
        if wall_s is None:
            return None
        return self.mono_ns + round(float(wall_s) * 1e9) - self.wall_ns + slack_ns

    def bounds(self, since: float | None, until: float | None) -> tuple[int | None, int | None]:
        return self.to_ns(since, -SLACK_NS), self.to_ns(until, SLACK_NS)

    def wall(self, t_ns: Any) -> Any:
        """Wall seconds of monotonic ns (scalar, array or Series; None/NaN stay missing)."""
        if t_ns is None:
            return None
        return (t_ns - self.mono_ns + self.wall_ns) / 1e9


def runs_of(conn: Any, engine_id: str | None, run_id: str | None) -> list[Run]:
    r = schema.runs
    q = select(r.c.id, r.c.engine_id, r.c.run_id, r.c.clock_wall_ns, r.c.clock_mono_ns, r.c.started)
    if engine_id is not None:
        q = q.where(r.c.engine_id == engine_id)
    if run_id is not None:
        q = q.where(r.c.run_id == run_id)
    return [Run(row._mapping) for row in conn.execute(q.order_by(r.c.started, r.c.id))]


def has_cap_column(conn: Any) -> bool:
    """Whether ``steps`` has revision 0002's ``long_prefill_token_threshold``."""
    return any(
        c["name"] == "long_prefill_token_threshold" for c in inspect(conn).get_columns("steps")
    )


def fetch_rows(conn: Any, stmt: Any) -> list[tuple[Any, ...]]:
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


def window_conds(col: Any, lo: float | None, hi: float | None) -> list[Any]:
    conds = []
    if lo is not None:
        conds.append(col >= lo)
    if hi is not None:
        conds.append(col <= hi)
    return conds


def frame_of(rows: list[dict[str, Any]] | pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    if isinstance(rows, pd.DataFrame):
        df = rows
    else:
        df = pd.DataFrame(rows)
    if df.empty:
        return empty(columns)
    return df[columns].reset_index(drop=True)


def concat_frames(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    if not frames:
        return empty(columns)
    if len(frames) == 1:
        return frames[0][columns].reset_index(drop=True)
    return pd.concat(frames, ignore_index=True)[columns]


def request_lookup(conn: Any, run_key: int, req_nos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def token_records(
    conn: Any, run: Run, lo: int | None, hi: int | None, after_ns: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, end_ns per token, step per token) of the steps starting in [lo, hi]."""
    s = schema.steps
    conds = [s.c.run_key == run.key, s.c.num_tokens_out > 0]
    conds += window_conds(s.c.start_ns, lo, hi)
    if after_ns is not None:
        conds += [s.c.start_ns >= after_ns - MAX_STEP_NS, s.c.end_ns > after_ns]
    rows = fetch_rows(
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
