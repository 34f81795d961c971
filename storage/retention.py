"""Retention: how big the store is, and pruning it by age and by size.

What is deleted, so that every reader stays consistent and ingest's seq rules hold:

- **Whole runs** that are not connected and not within their reconnection grace
  (:data:`RECONNECT_GRACE_S`: a run that lost its connection without a goodbye, or that was
  connected when the collector started, may be back any moment): their steps, request events,
  gaps and requests, their controls, then the ``runs`` row (and an ``engines`` row left without
  runs). The ``runs`` row
  goes last, in one transaction with the requests, and only while it still says
  ``connected = false``; a run whose engine reconnects meanwhile is kept (what was already
  deleted of it was its oldest data). An engine that later says hello for a deleted run starts
  it again as a new run at seq 0.
- **Old steps of a kept run** (a connected run, one within its grace, or one that ended after
  the cutoff): steps that
  started before the cutoff, request events and gaps before it, and requests that finished
  before it (a step after the cutoff only names requests still in flight then, so the
  dashboard's window reads never meet a step whose request row is gone). The ``runs`` row
  stays, with its ``last_seq``: the collector's duplicate and gap rules read that, not the
  rows, so a live run is never cut in a way that makes it accept or refuse the wrong seq.

Work is bounded: deletes go ``batch_rows`` rows per transaction (a few milliseconds of the
write lock, so the collector's writer waits no longer than a commit or two), and at most
``max_rows`` rows per call (None: until done); a call that stops early says so
(``complete=False``) and the next one goes on.

Size: SQLite counts the pages in use (``page_count - freelist_count``, times ``page_size``):
deleted rows free pages that later inserts reuse, so the file stops growing but does not
shrink until ``VACUUM`` (``chunkscope prune --vacuum``, with the collector stopped, since it
rewrites the file under an exclusive lock). PostgreSQL counts ``pg_total_relation_size`` of
the store's tables: deleted rows become free space after (auto)vacuum and are reused, but the
tables keep their size until ``VACUUM FULL``. Pruning by size therefore estimates what it
frees (each run's share of the stored events) instead of re-measuring, deletes that much
(down to ``LOW_WATER`` of the limit, so it does not run again on the next few steps), and the
collector's keeper measures again only once the size has grown past what it last saw.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, and_, delete, func, select, text

from storage import schema

logger = logging.getLogger(__name__)

LOW_WATER = 0.9  # a size prune brings the store down to this share of the limit
# A run that left without a goodbye is kept whole this long after it was last seen (and a run
# that was connected when the collector started, this long after the start): its engine retries
# with backoff and resends from the durable seq the runs row holds.
RECONNECT_GRACE_S = 600.0
DEFAULT_BATCH_ROWS = 5_000
TABLES = ("steps", "requests", "request_events", "controls", "gaps", "runs", "engines")


@dataclass
class StoreSize:
    """``used_bytes``: what the limits count (SQLite: pages in use; PostgreSQL: the tables'
    total relation size). ``file_bytes``: on disk (SQLite: the file and its WAL)."""

    used_bytes: int
    file_bytes: int


@dataclass
class PruneResult:
    runs_deleted: int = 0
    rows_deleted: int = 0
    size_before: int = 0
    size_after: int = 0
    complete: bool = True  # False: the row budget ran out first; call again
    estimated_freed: int = 0  # size pruning's estimate of the bytes it freed
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"deleted {self.runs_deleted} run(s) and {self.rows_deleted} row(s) in all; store "
            f"{_human(self.size_before)} -> {_human(self.size_after)}"
            + ("" if self.complete else " (stopped at the row budget: run again)")
        )


def _human(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"


def human_bytes(n: int) -> str:
    return _human(n)


def parse_bytes(value: str) -> int:
    """``10G``, ``512MiB``, ``1.5GB``, ``1000000`` -> bytes (K/M/G/T are powers of 1024)."""
    s = str(value).strip().upper().replace(" ", "")
    for suffix in ("IB", "B"):
        if s.endswith(suffix) and len(s) > len(suffix) and not s[: -len(suffix)][-1:].isdigit():
            s = s[: -len(suffix)]
            break
    if s.endswith("B") and s[:-1].replace(".", "", 1).isdigit():
        s = s[:-1]
    mult = 1
    if s and s[-1] in "KMGT":
        mult = 1024 ** ("KMGT".index(s[-1]) + 1)
        s = s[:-1]
    try:
        n = float(s)
    except ValueError:
        raise ValueError(f"not a size: {value!r} (e.g. 500M, 10G, 1T)") from None
    if not n > 0 or n == float("inf"):
        raise ValueError(f"a size must be positive, got {value!r}")
    return int(n * mult)


def parse_age(value: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``3600`` (seconds) -> seconds."""
    s = str(value).strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    mult = 1
    if s and s[-1] in units:
        mult = units[s[-1]]
        s = s[:-1]
    try:
        n = float(s)
    except ValueError:
        raise ValueError(f"not an age: {value!r} (e.g. 7d, 12h, 90m, 3600)") from None
    if not n > 0 or n == float("inf"):
        raise ValueError(f"an age must be positive, got {value!r}")
    return n * mult


def store_size(db: Engine) -> StoreSize:
    """The store's size now (see the module's docstring for what each backend counts)."""
    with db.connect() as conn:
        if db.dialect.name == "sqlite":
            page_size = int(conn.exec_driver_sql("PRAGMA page_size").scalar() or 0)
            pages = int(conn.exec_driver_sql("PRAGMA page_count").scalar() or 0)
            free = int(conn.exec_driver_sql("PRAGMA freelist_count").scalar() or 0)
            path = db.url.database
            on_disk = 0
            if path and path != ":memory:" and not path.startswith("file:"):
                for p in (Path(path), Path(path + "-wal")):
                    try:
                        on_disk += os.path.getsize(p)
                    except OSError:
                        pass
            return StoreSize(used_bytes=(pages - free) * page_size, file_bytes=on_disk)
        rows = conn.execute(
            text(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.relkind = 'r' AND n.nspname = current_schema() "
                "AND c.relname = ANY(:names)"
            ),
            {"names": [*TABLES, "alembic_version"]},
        ).scalar()
        n = int(rows or 0)
        return StoreSize(used_bytes=n, file_bytes=n)


class _Budget:
    def __init__(self, max_rows: int | None) -> None:
        self.left = max_rows

    def take(self, want: int) -> int:
        return want if self.left is None else max(0, min(want, self.left))

    def spend(self, n: int) -> None:
        if self.left is not None:
            self.left -= n

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0


def _chunked_delete(
    db: Engine, table: Any, key_cols: list[Any], where: Any, batch: int, budget: _Budget
) -> tuple[int, bool]:
    """Delete the rows of ``table`` matching ``where``, ``batch`` rows per transaction, within
    ``budget``. Returns (rows deleted, all matching rows gone)."""
    total = 0
    while True:
        n = budget.take(batch)
        if n <= 0:
            return total, False
        if len(key_cols) == 1:
            sub = select(key_cols[0]).where(where).limit(n).scalar_subquery()
            stmt = delete(table).where(key_cols[0].in_(sub))
        else:  # (run_key, x): one run at a time, so the second column alone picks the rows
            run_col, col = key_cols
            sub = select(col).where(where).order_by(col).limit(n).scalar_subquery()
            stmt = delete(table).where(and_(where, col.in_(sub)))
        with db.begin() as conn:
            deleted = int(conn.execute(stmt).rowcount or 0)
        total += deleted
        budget.spend(deleted)
        if deleted < n:
            return total, True


def _delete_run(db: Engine, run: Any, batch: int, budget: _Budget) -> tuple[int, bool]:
    """Delete a run that is not connected. Returns (rows deleted, the run is gone)."""
    k = run.id
    total = 0
    r = schema.runs
    for table, cols in (
        (schema.steps, [schema.steps.c.run_key, schema.steps.c.seq]),
        (schema.request_events, [schema.request_events.c.run_key, schema.request_events.c.seq]),
        (schema.gaps, [schema.gaps.c.run_key, schema.gaps.c.seq]),
    ):
        with db.connect() as conn:  # the engine may have come back meanwhile: keep its run
            if conn.execute(select(r.c.connected).where(r.c.id == k)).scalar() is not False:
                return total, False
        n, done = _chunked_delete(db, table, cols, table.c.run_key == k, batch, budget)
        total += n
        if not done:
            return total, False
    c = schema.controls
    n, done = _chunked_delete(
        db, c, [c.c.id], and_(c.c.engine_id == run.engine_id, c.c.run_id == run.run_id), batch,
        budget,
    )  # fmt: skip
    total += n
    if not done:
        return total, False
    req = schema.requests
    with db.begin() as conn:
        # the runs row first: from here the writer's hello (FOR UPDATE on PostgreSQL, the
        # write lock on SQLite) sees either the live run or no run, never half of one
        gone = conn.execute(delete(r).where(r.c.id == k, r.c.connected.is_(False))).rowcount
        if not gone:
            return total, False
        n_req = int(conn.execute(delete(req).where(req.c.run_key == k)).rowcount or 0)
        e = schema.engines
        conn.execute(
            delete(e).where(
                e.c.engine_id == run.engine_id,
                ~select(r.c.id).where(r.c.engine_id == run.engine_id).exists(),
            )
        )
    budget.spend(n_req + 1)
    return total + n_req + 1, True


def _prune_before(
    db: Engine, run: Any, t_cut_ns: int, wall_cut: float, batch: int, budget: _Budget
) -> tuple[int, bool]:
    """Delete a kept run's data from before ``t_cut_ns`` (its monotonic clock)."""
    total = 0
    s, ev, g, req, c = (
        schema.steps,
        schema.request_events,
        schema.gaps,
        schema.requests,
        schema.controls,
    )
    k = run.id
    jobs = [
        (s, [s.c.run_key, s.c.seq], and_(s.c.run_key == k, s.c.start_ns < t_cut_ns)),
        (ev, [ev.c.run_key, ev.c.seq], and_(ev.c.run_key == k, ev.c.time_ns < t_cut_ns)),
        (g, [g.c.run_key, g.c.seq], and_(g.c.run_key == k, g.c.time_ns < t_cut_ns)),
        (
            req,
            [req.c.run_key, req.c.req_no],
            and_(
                req.c.run_key == k,
                req.c.finished_ns < t_cut_ns,
                func.coalesce(req.c.last_token_ns, 0) < t_cut_ns,
            ),
        ),
        (
            c,
            [c.c.id],
            and_(c.c.engine_id == run.engine_id, c.c.run_id == run.run_id, c.c.wall < wall_cut),
        ),
    ]
    for table, cols, where in jobs:
        n, done = _chunked_delete(db, table, cols, where, batch, budget)
        total += n
        if not done:
            return total, False
    return total, True


def _to_mono_ns(run: Any, wall_s: float) -> int:
    return int(wall_s * 1e9) - int(run.clock_wall_ns) + int(run.clock_mono_ns)


def _runs(db: Engine) -> list[Any]:
    r = schema.runs
    with db.connect() as conn:
        return list(
            conn.execute(
                select(
                    r.c.id,
                    r.c.engine_id,
                    r.c.run_id,
                    r.c.connected,
                    r.c.started,
                    r.c.ended,
                    r.c.last_seen,
                    r.c.clock_wall_ns,
                    r.c.clock_mono_ns,
                    r.c.num_events,
                ).order_by(r.c.started, r.c.id)
            )
        )


def _kept_whole(run: Any, now: float, grace_s: float, keep: frozenset[int]) -> bool:
    """A run that no prune deletes whole: connected, named in ``keep`` (connected when the
    collector started, within the grace), or gone without a goodbye less than ``grace_s`` ago."""
    if run.connected or run.id in keep:
        return True
    if run.ended is not None:
        return False
    last = run.last_seen if run.last_seen is not None else run.started
    return last is not None and last > now - grace_s


def prune(
    db: Engine,
    *,
    older_than_s: float | None = None,
    max_bytes: int | None = None,
    now: float | None = None,
    max_rows: int | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    already_freed: int = 0,
    grace_s: float = RECONNECT_GRACE_S,
    keep_whole: frozenset[int] = frozenset(),
) -> PruneResult:
    """Delete data older than ``older_than_s`` seconds and, while the store is over
    ``max_bytes``, the oldest runs (then the oldest steps of live runs). ``already_freed``: bytes
    an earlier, unfinished size prune of this same size already freed (PostgreSQL). Runs that
    are connected, within ``grace_s`` of leaving without a goodbye, or in ``keep_whole`` are
    never deleted whole (only their data before the cutoff, as a live run's)."""
    if older_than_s is not None and not older_than_s > 0:
        raise ValueError(f"older_than_s must be positive, got {older_than_s}")
    if max_bytes is not None and not max_bytes > 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    now = time.time() if now is None else now
    budget = _Budget(max_rows)
    size0 = store_size(db).used_bytes
    res = PruneResult(size_before=size0, size_after=size0)

    def finish(complete: bool) -> PruneResult:
        res.complete = complete
        res.size_after = store_size(db).used_bytes
        return res

    if older_than_s is not None:
        cutoff = now - older_than_s
        for run in _runs(db):
            last = run.ended if run.ended is not None else (run.last_seen or run.started)
            if not _kept_whole(run, now, grace_s, keep_whole) and last < cutoff:
                n, gone = _delete_run(db, run, batch_rows, budget)
                res.rows_deleted += n
                if gone:
                    res.runs_deleted += 1
                elif budget.spent:
                    return finish(False)
                continue
            # a kept run (live, or ended after the cutoff) may hold older data: its own clock
            # says which (``started`` is the collector's time of the first hello)
            n, done = _prune_before(db, run, _to_mono_ns(run, cutoff), cutoff, batch_rows, budget)
            res.rows_deleted += n
            if not done:
                return finish(False)
        c = schema.controls
        n, done = _chunked_delete(
            db, c, [c.c.id], and_(c.c.run_id.is_(None), c.c.wall < cutoff), batch_rows, budget
        )
        res.rows_deleted += n
        if not done:
            return finish(False)

    if max_bytes is not None:
        size = store_size(db).used_bytes if older_than_s is not None else size0
        need = size - already_freed - int(max_bytes * LOW_WATER)
        if size > max_bytes and need > 0:
            runs = _runs(db)
            total_events = sum(max(0, int(r.num_events or 0)) for r in runs) or 1
            per_event = size / total_events
            for run in runs:
                if need <= 0:
                    break
                if _kept_whole(run, now, grace_s, keep_whole):
                    continue
                n, gone = _delete_run(db, run, batch_rows, budget)
                res.rows_deleted += n
                if gone:
                    res.runs_deleted += 1
                    freed = int(per_event * max(1, int(run.num_events or 0)))
                    need -= freed
                    res.estimated_freed += freed
                elif budget.spent:
                    return finish(False)
            if need > 0:  # only live runs left: their oldest steps, the same share of each
                share = min(1.0, need / max(1, size))
                for run in _runs(db):
                    if not _kept_whole(run, now, grace_s, keep_whole):
                        continue
                    t_cut = _oldest_share_cut(db, run.id, share)
                    if t_cut is None:
                        continue
                    wall_cut = (int(run.clock_wall_ns) + t_cut - int(run.clock_mono_ns)) / 1e9
                    n, done = _prune_before(db, run, t_cut, wall_cut, batch_rows, budget)
                    res.rows_deleted += n
                    if not done:
                        return finish(False)
                res.estimated_freed += need
    return finish(True)


def _oldest_share_cut(db: Engine, run_key: int, share: float) -> int | None:
    """The start_ns before which lie about ``share`` of a run's stored steps (by seq)."""
    s = schema.steps
    with db.connect() as conn:
        lo, hi = conn.execute(
            select(func.min(s.c.seq), func.max(s.c.seq)).where(s.c.run_key == run_key)
        ).one()
        if lo is None:
            return None
        cut_seq = int(lo + share * (hi - lo + 1))
        t = conn.execute(
            select(s.c.start_ns)
            .where(s.c.run_key == run_key, s.c.seq >= cut_seq)
            .order_by(s.c.seq)
            .limit(1)
        ).scalar()
    return int(t) if t is not None else None


def vacuum(db: Engine) -> None:
    """Give freed space back to the file system: SQLite ``VACUUM`` (rewrites the file; needs
    no other writer), PostgreSQL ``VACUUM FULL`` of the store's tables (locks each table while
    it is rewritten). With the collector stopped."""
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if db.dialect.name == "sqlite":
            conn.exec_driver_sql("VACUUM")
        else:
            for table in TABLES:
                conn.exec_driver_sql(f"VACUUM FULL {table}")


class Keeper:
    """The collector's retention: every ``interval`` seconds on its own thread, measure the
    store (for ``/metrics``) and, when limits are set, prune at most ``max_rows`` rows a pass."""

    def __init__(
        self,
        db: Engine,
        *,
        older_than_s: float | None = None,
        max_bytes: int | None = None,
        max_rows: int = 50_000,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        grace_s: float = RECONNECT_GRACE_S,
    ) -> None:
        self.db = db
        self.grace_s = grace_s
        self._restart_keys: frozenset[int] = frozenset()
        self._restart_at = time.monotonic()
        # engine id -> (run key, run id, wall time last seen; None: connected) of the run most
        # likely to hold its control route when the collector stopped: its oldest run still
        # connected then, else the one last seen of those that left without a goodbye
        self.runs_at_restart: dict[str, tuple[int, str, float | None]] = {}
        self.older_than_s = older_than_s
        self.max_bytes = max_bytes
        self.max_rows = max_rows
        self.batch_rows = batch_rows
        self.size: StoreSize | None = None
        self._pg = db.dialect.name != "sqlite"
        self._size_at_last_prune: int | None = None  # PostgreSQL: free space not measurable
        self._freed_pending = 0

    def note_restart(self) -> None:
        """Before the collector's store marks the runs left connected as ended without goodbye:
        remember them, so that they are kept whole for ``grace_s`` from now (their engines are
        reconnecting; how long ago they were last seen says nothing while the collector was
        down)."""
        r = schema.runs
        with self.db.connect() as conn:
            rows = conn.execute(
                select(r.c.id, r.c.engine_id, r.c.run_id, r.c.connected, r.c.last_seen, r.c.started)
                .where(r.c.connected.is_(True) | r.c.ended.is_(None))
                .order_by(r.c.id)
            ).all()
        self._restart_keys = frozenset(int(row.id) for row in rows if row.connected)
        self.runs_at_restart = {}
        for row in rows:
            engine_id = str(row.engine_id)
            had = self.runs_at_restart.get(engine_id)
            if row.connected:
                if had is None or had[2] is not None:
                    self.runs_at_restart[engine_id] = (int(row.id), str(row.run_id), None)
                continue
            last = float(row.last_seen if row.last_seen is not None else row.started or 0.0)
            if had is None or (had[2] is not None and last > had[2]):
                self.runs_at_restart[engine_id] = (int(row.id), str(row.run_id), last)
        self._restart_at = time.monotonic()

    def run_once(self) -> PruneResult | None:
        """One pass: prune (when limits are set), then measure. Returns what was pruned."""
        result = None
        if self._restart_keys and time.monotonic() - self._restart_at > self.grace_s:
            self._restart_keys = frozenset()
        if self.older_than_s is not None or self.max_bytes is not None:
            max_bytes = self.max_bytes
            if self._pg and max_bytes is not None and self._size_at_last_prune is not None:
                size = store_size(self.db).used_bytes
                if size <= self._size_at_last_prune:
                    max_bytes = None  # the space freed last time is still being reused
                else:
                    self._size_at_last_prune = None
                    self._freed_pending = 0
            result = prune(
                self.db,
                older_than_s=self.older_than_s,
                max_bytes=max_bytes,
                max_rows=self.max_rows,
                batch_rows=self.batch_rows,
                already_freed=self._freed_pending,
                grace_s=self.grace_s,
                keep_whole=self._restart_keys,
            )
            if self._pg and max_bytes is not None and result.estimated_freed:
                if result.complete:
                    self._size_at_last_prune = result.size_after
                    self._freed_pending = 0
                else:
                    self._freed_pending += result.estimated_freed
            if result.rows_deleted:
                logger.info("retention: %s", result.describe())
        self.size = store_size(self.db)
        return result
