"""The write side of the store: turns contract events into rows, in batches, on one connection.

``Store`` is synchronous and single-threaded; the collector runs it on its writer thread
(``storage.writer``), which is the only code that writes. ``Store.apply(ops)`` handles a list of
operations in ONE transaction and returns one result per operation only after the commit, so an
acknowledgement built from a result is always durable.

Idempotence: each run remembers its highest stored ``seq`` (``runs.last_seq``, updated in the same
transaction as the rows); an event whose seq is not above it is a resend and is skipped, and the
primary keys (run_key, seq) make a double row impossible even if that logic were wrong.

No holes: the durable seq only ever moves to the next seq, or over seqs a ``gap`` event declares
lost. An ``Events`` op whose first new seq would skip an unstored one (the op before it failed
and this one was queued behind it) is refused whole with :class:`SeqHole` as its result, so an
acknowledgement never covers a seq that is neither stored nor declared lost.

Token times are stamped here: a step's chunk with ``produced_token`` gives its request token
``k = previous k + 1`` at the step's ``end_ns`` (the request's ``num_tokens`` / ``last_token_ns``
carry the count across batches and restarts), and ``itl_ns = end_ns - time of token k-1``.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Connection, Engine, bindparam, exists, func, insert, select, true, update
from sqlalchemy.sql.elements import ColumnElement

from storage import ingest, schema, stamping
from storage.fleet import STALE_AFTER_S
from storage.frames import STEP_COUNTS, CheckedEvent, Chunk
from storage.packing import FLAG_CAPPED, FLAG_DECODE, FLAG_PRODUCED, pack_chunks, pack_tokens
from storage.stamping import PlainStep

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1

_REQ_MUTABLE = (
    "traffic_class",
    "num_prompt_tokens",
    "num_image_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "num_preemptions",
    "arrival_ns",
    "first_scheduled_ns",
    "finished_ns",
    "finish_reason",
    "num_tokens",
    "first_token_ns",
    "last_token_ns",
    "first_token_step",
    "last_token_step",
    "max_itl_ns",
)
_LOOKUP_IDS = 500  # request ids per lookup query (SQLite allows 32,766 parameters)
# Unfinished requests one run keeps in memory: past it the least recently active quarter is
# dropped after a commit (they are in the database and read back when an event names them), so
# requests an engine never finishes cannot grow the writer's memory without end
MAX_REQUESTS_IN_MEMORY = 8192
# New runs one engine id may start within RUNS_WINDOW seconds (counted in the store, so a
# restarted collector counts the same): a hello for a further new run is refused and creates
# nothing; a run already registered always reconnects
DEFAULT_MAX_RUNS_PER_ENGINE = 300
DEFAULT_RUNS_WINDOW = 3600.0
_req_mutable = operator.attrgetter(*_REQ_MUTABLE)  # all of them in one C call
_REQUEST_ID = operator.attrgetter("request_id")
_GAP_PAST_INT64 = stamping.GAP_PAST_INT64
_REQ_COUNTS = ("num_prompt_tokens", "num_image_tokens", "num_cached_tokens", "num_output_tokens")
_STEP_INTS = STEP_COUNTS
_RUN_MUTABLE = (
    "token_budget",
    "policy",
    "max_token_budget",
    "ended",
    "ended_without_goodbye",
    "connected",
    "last_seen",
    "last_seq",
    "last_step",
    "last_step_end_ns",
    "num_steps",
    "num_events",
    "num_gap_events",
    "next_req_no",
)


def _update_requests_pg() -> str:
    """One UPDATE of many requests on PostgreSQL, from one array per column (``unnest``)."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    c = schema.requests.c
    names = ["run_key", "req_no", *_REQ_MUTABLE]
    arrays = ", ".join(f"%s::{c[name].type.compile(dialect=dialect)}[]" for name in names)
    return (
        f"UPDATE {schema.requests.name} AS r SET "
        + ", ".join(f"{name} = v.{name}" for name in _REQ_MUTABLE)
        + f" FROM unnest({arrays}) AS v({', '.join(names)})"
        + " WHERE r.run_key = v.run_key AND r.req_no = v.req_no"
    )


_UPDATE_REQUESTS_PG = _update_requests_pg()


@functools.cache
def _pg_type(table: Any, name: str) -> str:
    """The PostgreSQL type of ``table``'s column ``name`` ("integer", "bytea", ...)."""
    from sqlalchemy.dialects import postgresql

    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    return str(table.c[name].type.compile(dialect=dialect)).lower()


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if not -INT64_MAX <= value <= INT64_MAX:
        raise ValueError(f"{name} out of the 64-bit range: {value}")
    return value


def _opt_int(value: Any, name: str) -> int | None:
    return None if value is None else _int(value, name)


def _json_text(value: Any) -> str:
    """``value`` as JSON text; ValueError for NaN or an infinity (not JSON: a reader or an
    export would fail on it)."""
    return json.dumps(value, default=str, allow_nan=False)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _hole(events: list[dict[str, Any]], expected: int) -> int | None:
    """The first seq that ``events`` would leave unstored when the run's next seq is
    ``expected`` (None when none): each new seq must be the next one, unless it is a ``gap``
    event declaring the seqs before it lost. Resent seqs (below ``expected``) are skipped."""
    for ev in events:
        seq = ev["seq"]
        if seq < expected:
            continue
        if seq != expected and not ingest.declares(ev, expected):
            return expected
        expected = seq + 1
    return None


@dataclass(eq=False)
class RequestState:
    req_no: int
    request_id: str
    persisted: bool = False
    traffic_class: str | None = None
    num_prompt_tokens: int = 0
    num_image_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    arrival_ns: int | None = None
    first_scheduled_ns: int | None = None
    finished_ns: int | None = None
    finish_reason: str | None = None
    num_tokens: int = 0
    first_token_ns: int | None = None
    last_token_ns: int | None = None
    first_token_step: int | None = None
    last_token_step: int | None = None
    max_itl_ns: int | None = None

    def row(self, run_key: int) -> dict[str, Any]:
        d = dict(zip(_REQ_MUTABLE, _req_mutable(self), strict=True))
        d.update(run_key=run_key, req_no=self.req_no, request_id=self.request_id)
        return d


@dataclass(eq=False)
class RunState:
    """What the writer keeps in memory about one run (reloaded from the database when needed)."""

    run_key: int
    engine_id: str
    run_id: str
    wall_ns: int
    mono_ns: int
    token_budget: int | None = None
    policy: str | None = None
    max_token_budget: int | None = None
    ended: float | None = None
    ended_without_goodbye: bool = False
    connected: bool = False
    last_seen: float | None = None
    last_seq: int = 0
    last_step: int | None = None
    last_step_end_ns: int | None = None
    num_steps: int = 0
    num_events: int = 0
    num_gap_events: int = 0
    next_req_no: int = 0
    requests: dict[str, RequestState] = field(default_factory=dict)
    # True when some of this run's requests may be in the database but not in ``requests``
    # (finished ones are evicted from memory after their commit).
    partial: bool = False

    def wall(self, t_ns: int) -> float:
        return (self.wall_ns + (t_ns - self.mono_ns)) / 1e9

    def row(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _RUN_MUTABLE}


def _drop_idle_requests(run: RunState) -> None:
    """Forget the least recently active quarter of ``run``'s requests held in memory (all
    committed: the caller runs after the commit); they are read back when an event names them."""
    held = [req for req in run.requests.values() if req.persisted]
    keep = MAX_REQUESTS_IN_MEMORY * 3 // 4
    if len(run.requests) - len(held) > keep:
        return  # nothing committed to drop
    held.sort(key=_last_active)
    for req in held[: len(run.requests) - keep]:
        del run.requests[req.request_id]
    run.partial = True


def _last_active(req: RequestState) -> int:
    return max(req.last_token_ns or 0, req.first_scheduled_ns or 0, req.arrival_ns or 0)


# ---- operations -------------------------------------------------------------------------------


@dataclass
class Hello:
    """Register (or re-register) a run from its hello; result: ``RunInfo``."""

    hello: dict[str, Any]
    received: float = field(default_factory=time.time)


@dataclass
class Events:
    """Store a batch of one run's events; result: ``EventsResult``."""

    run_key: int
    events: list[dict[str, Any]]
    received: float = field(default_factory=time.monotonic)
    tag: Any = None  # the collector's handle on the connection that sent them


@dataclass
class Disconnect:
    """The run's connection closed (result: None). Without a goodbye it is marked
    ``ended_without_goodbye`` until the same run says hello again."""

    run_key: int


@dataclass
class CollectorControl:
    """A control refused by the collector itself (stored with source "collector")."""

    engine_id: str
    run_id: str | None
    key: str | None
    old_value: Any
    new_value: Any
    reason: str
    request_id: str | None
    wall: float = field(default_factory=time.time)
    source: str = "collector"
    accepted: bool = False


@dataclass
class RunInfo:
    run_key: int
    last_seq: int
    token_budget: int | None
    max_token_budget: int | None
    policy: str | None
    proven: bool = False  # the hello presented the run's secret
    refused: str = ""  # why the hello may not speak for this run (nothing was changed)
    too_many_runs: bool = False  # refused: its engine id has started too many runs of late


@dataclass
class EventsResult:
    run_key: int
    last_seq: int
    stored: int
    duplicates: int
    unknown_types: list[str]
    bad: list[tuple[int, str]]  # (seq, why) of events that could not be read
    counts: dict[str, int]  # stored events by type


class _Batch:
    """Rows collected while applying a list of operations, written at the end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.request_events: list[dict[str, Any]] = []
        self.controls: list[dict[str, Any]] = []
        self.gaps: list[dict[str, Any]] = []
        self.dirty_requests: dict[int, dict[int, RequestState]] = {}
        self.dirty_runs: dict[int, RunState] = {}
        # run_key -> request ids looked up in this transaction and not in the database
        self.not_stored: dict[int, set[str]] = {}
        # a shared store: run key -> its durable seq as locked by this transaction, until
        # the run's first Events op checked it
        self.fenced: dict[int, int] = {}
        # run key -> the run and its steps from storage.frames whose chunks and token times
        # are not stamped yet (Store._stamp_plain, all of a run's at once)
        self.plain: dict[int, tuple[RunState, list[PlainStep]]] = {}

    def touch(self, run: RunState, req: RequestState) -> None:
        self.dirty_requests.setdefault(run.run_key, {})[req.req_no] = req


class SeqHole(RuntimeError):
    """An ``Events`` op refused whole: its first new seq is not the run's durable seq + 1 and no
    ``gap`` event declares the seqs between lost. Returned as the op's result (nothing of it is
    stored, the batch goes on); ``expected`` is the seq the run needs next."""

    def __init__(self, message: str, expected: int) -> None:
        super().__init__(message)
        self.expected = expected


class RunGone(RuntimeError):
    """A run's row was deleted (by a prune) while the writer held it in memory."""


class Store:
    """The writer's state and its one write connection."""

    def __init__(
        self,
        db: Engine,
        *,
        sqlite_autocheckpoint: bool = True,
        shared: bool | None = None,
        max_runs_per_engine: int | None = DEFAULT_MAX_RUNS_PER_ENGINE,
        runs_window: float = DEFAULT_RUNS_WINDOW,
    ) -> None:
        """``sqlite_autocheckpoint=False`` leaves WAL checkpoints to someone else (the writer
        runs them on a thread of their own, so a checkpoint's fsync never delays a commit).
        ``shared``: other collectors may write the same runs (a fleet on one PostgreSQL, the
        default there): each batch locks its runs' rows and reloads a run whose durable seq
        another collector moved (an engine that failed over and back).
        ``max_runs_per_engine``: new runs one engine id may start within ``runs_window``
        seconds (None: no limit)."""
        self.db = db
        self.max_runs_per_engine = max_runs_per_engine
        self.runs_window = runs_window
        self._autocheckpoint = sqlite_autocheckpoint
        self.shared = db.dialect.name == "postgresql" if shared is None else shared
        # PostgreSQL: the event tables take their rows by COPY (see _append)
        self.copy = db.dialect.name == "postgresql"
        self._conn: Connection | None = None
        self._runs: dict[int, RunState] = {}
        self._upd_requests = (
            update(schema.requests)
            .where(
                schema.requests.c.run_key == bindparam("b_run_key"),
                schema.requests.c.req_no == bindparam("b_req_no"),
            )
            .values({name: bindparam(name) for name in _REQ_MUTABLE})
        )
        self._upd_runs = (
            update(schema.runs)
            .where(schema.runs.c.id == bindparam("b_id"))
            .values({name: bindparam(name) for name in _RUN_MUTABLE})
        )

    # -- connection ---------------------------------------------------------------------------

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            self._conn = self.db.connect()
            if not self._autocheckpoint and self.db.dialect.name == "sqlite":
                self._conn.exec_driver_sql("PRAGMA wal_autocheckpoint = 0")
                self._conn.commit()
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def startup(self) -> int:
        """Runs left marked connected by a collector that died are ended without goodbye until
        they reconnect. Returns how many."""
        r = self.runs_table
        live: ColumnElement[bool] = true()
        if self.shared:
            # in a fleet, a run connected through another collector that is alive stays so
            fe, fc = schema.fleet_engines, schema.fleet_collectors
            live = ~exists().where(
                fe.c.engine_id == r.c.engine_id,
                fe.c.run_id == r.c.run_id,
                fe.c.connected.is_(True),
                fc.c.collector_id == fe.c.collector_id,
                fc.c.heartbeat >= time.time() - STALE_AFTER_S,
            )
        with self.conn.begin():
            result = self.conn.execute(
                update(r)
                .where(r.c.connected.is_(True), r.c.ended.is_(None), live)
                .values(connected=False, ended_without_goodbye=True)
            )
            self.conn.execute(
                update(r).where(r.c.connected.is_(True), live).values(connected=False)
            )
        return int(result.rowcount or 0)

    runs_table = schema.runs

    # -- apply --------------------------------------------------------------------------------

    def apply(self, ops: list[Any]) -> list[Any]:
        """Apply ``ops`` in one transaction; one result per op, after the commit.

        On a database error the transaction is rolled back, the in-memory run states are
        dropped (reloaded on next use) and the error is raised.
        """
        batch = _Batch()
        results: list[Any] = []
        try:
            with self.conn.begin():
                if self.shared:
                    self._lock_runs(ops, batch)
                self._look_up_batch(ops, batch)
                for op in ops:
                    if batch.plain and not isinstance(op, Events):
                        self._stamp_pending(batch)  # a hello reads a run's settings
                    results.append(self._apply_one(op, batch))
                self._stamp_pending(batch)
                self._flush(batch)
        except BaseException:
            self._runs.clear()
            self.close()
            raise
        for run_key, reqs in batch.dirty_requests.items():
            run = self._runs.get(run_key)
            if run is None:
                continue
            for req in reqs.values():
                req.persisted = True
                if req.finished_ns is not None:
                    run.requests.pop(req.request_id, None)
                    run.partial = True
            if len(run.requests) > MAX_REQUESTS_IN_MEMORY:
                _drop_idle_requests(run)
        for run in batch.dirty_runs.values():
            if not run.connected and self._runs.get(run.run_key) is run:
                # its connection is gone and everything of it is committed: it is read back
                # from the database if it comes back, so memory holds the connected runs only
                del self._runs[run.run_key]
        return results

    def _apply_one(self, op: Any, batch: _Batch) -> Any:
        if isinstance(op, Events):
            return self._events(op, batch)
        if isinstance(op, Hello):
            return self._hello(op, batch)
        if isinstance(op, Disconnect):
            run = self._run(op.run_key)
            run.connected = False
            run.last_seen = time.time()
            if run.ended is None:
                run.ended_without_goodbye = True
            batch.dirty_runs[run.run_key] = run
            return None
        if isinstance(op, CollectorControl):
            batch.controls.append(
                {
                    "engine_id": op.engine_id,
                    "run_id": op.run_id,
                    "seq": None,
                    "time_ns": None,
                    "wall": op.wall,
                    "key": op.key,
                    "old_value": _json_text(op.old_value),
                    "new_value": _json_text(op.new_value),
                    "accepted": op.accepted,
                    "source": op.source,
                    "applied_at_step": None,
                    "reason": op.reason,
                    "request_id": op.request_id,
                }
            )
            return None
        raise TypeError(f"unknown store operation {op!r}")

    # -- runs ---------------------------------------------------------------------------------

    def _run(self, run_key: int) -> RunState:
        run = self._runs.get(run_key)
        if run is not None:
            return run
        row = self.conn.execute(select(schema.runs).where(schema.runs.c.id == run_key)).first()
        if row is None:
            raise RunGone(f"no run with key {run_key}: deleted meanwhile (pruned)")
        m = row._mapping
        run = RunState(
            run_key=run_key,
            engine_id=m["engine_id"],
            run_id=m["run_id"],
            wall_ns=m["clock_wall_ns"],
            mono_ns=m["clock_mono_ns"],
            partial=True,
            **{name: m[name] for name in _RUN_MUTABLE},
        )
        req = schema.requests
        for r in self.conn.execute(  # the newest ones; ``partial`` finds the others
            select(req)
            .where(req.c.run_key == run_key, req.c.finished_ns.is_(None))
            .order_by(req.c.req_no.desc())
            .limit(MAX_REQUESTS_IN_MEMORY)
        ):
            state = self._request_from_row(r._mapping)
            run.requests[state.request_id] = state
        self._runs[run_key] = run
        return run

    @staticmethod
    def _request_from_row(m: Any) -> RequestState:
        state = RequestState(req_no=m["req_no"], request_id=m["request_id"], persisted=True)
        for name in _REQ_MUTABLE:
            setattr(state, name, m[name])
        return state

    def _hello(self, op: Hello, batch: _Batch) -> RunInfo:
        h = op.hello
        engine_id, run_id = str(h["engine_id"]), str(h["run_id"])
        clock = h["clock"]
        now = op.received
        r = schema.runs
        row = self.conn.execute(
            select(r.c.id, r.c.secret_sha256)
            .where(r.c.engine_id == engine_id, r.c.run_id == run_id)
            # PostgreSQL: wait for a prune deleting this run, then see it gone (not half of it)
            .with_for_update()
        ).first()
        verdict = ingest.claim(
            registered=row is not None,
            stored_hash=row[1] if row is not None else None,
            secret=h.get("run_secret"),
        )
        if verdict.refused:
            return RunInfo(0, 0, None, None, None, refused=verdict.refused)
        if row is None:
            too_many = self._too_many_runs(engine_id, now)
            if too_many:
                return RunInfo(0, 0, None, None, None, refused=too_many, too_many_runs=True)
        e = schema.engines
        found = self.conn.execute(select(e.c.engine_id).where(e.c.engine_id == engine_id)).first()
        if found is None:
            self.conn.execute(
                insert(e).values(
                    engine_id=engine_id,
                    host=_opt_str(h.get("host")),
                    model=_opt_str(h.get("model")),
                    first_seen=now,
                    last_seen=now,
                )
            )
        else:
            self.conn.execute(
                update(e)
                .where(e.c.engine_id == engine_id)
                .values(host=_opt_str(h.get("host")), model=_opt_str(h.get("model")), last_seen=now)
            )
        if row is None:
            hello_copy = {k: v for k, v in h.items() if k not in ("token", "run_secret")}
            result = self.conn.execute(
                insert(r).values(
                    engine_id=engine_id,
                    run_id=run_id,
                    model=_opt_str(h.get("model")),
                    host=_opt_str(h.get("host")),
                    pid=_opt_int(h.get("pid"), "pid"),
                    policy=_opt_str(h.get("policy")),
                    token_budget=_opt_int(h.get("token_budget"), "token_budget"),
                    max_token_budget=_opt_int(h.get("max_token_budget"), "max_token_budget"),
                    kv_blocks_total=_opt_int(h.get("kv_blocks_total"), "kv_blocks_total"),
                    block_size=_opt_int(h.get("block_size"), "block_size"),
                    config=_json_text(h.get("config")),
                    hello=_json_text(hello_copy),
                    clock_wall_ns=_int(clock["wall_ns"], "clock.wall_ns"),
                    clock_mono_ns=_int(clock["mono_ns"], "clock.mono_ns"),
                    started=now,
                    ended=None,
                    ended_without_goodbye=False,
                    connected=True,
                    last_seen=now,
                    last_seq=0,
                    num_steps=0,
                    num_events=0,
                    num_gap_events=0,
                    next_req_no=0,
                    secret_sha256=verdict.register,
                )
            )
            run_key = int(result.inserted_primary_key[0])
            run = RunState(
                run_key=run_key,
                engine_id=engine_id,
                run_id=run_id,
                wall_ns=clock["wall_ns"],
                mono_ns=clock["mono_ns"],
                token_budget=_opt_int(h.get("token_budget"), "token_budget"),
                policy=_opt_str(h.get("policy")),
                max_token_budget=_opt_int(h.get("max_token_budget"), "max_token_budget"),
                connected=True,
                last_seen=now,
            )
            self._runs[run_key] = run
        else:
            key = int(row[0])
            if key not in batch.dirty_runs:
                # read afresh: another collector of a shared store may have stored this run's
                # events since this one last held it (the engine failed over and came back).
                # Never a run this batch has changed: its events before this hello are not
                # flushed yet, and a reread would answer (and store) an older durable seq.
                self._runs.pop(key, None)
            run = self._run(key)
            run.connected = True
            run.ended_without_goodbye = False
            run.last_seen = now
            if h.get("token_budget") is not None:
                run.token_budget = _int(h["token_budget"], "token_budget")
            if h.get("max_token_budget") is not None:
                run.max_token_budget = _int(h["max_token_budget"], "max_token_budget")
            if h.get("policy") is not None:
                run.policy = str(h["policy"])
            batch.dirty_runs[run.run_key] = run
        return RunInfo(
            run.run_key,
            run.last_seq,
            run.token_budget,
            run.max_token_budget,
            run.policy,
            proven=verdict.proven,
        )

    def _too_many_runs(self, engine_id: str, now: float) -> str:
        """Why ``engine_id`` may not start another run now ("" when it may)."""
        cap = self.max_runs_per_engine
        if cap is None:
            return ""
        r = schema.runs
        since = now - self.runs_window
        started = self.conn.execute(
            select(func.count())
            .select_from(r)
            .where(r.c.engine_id == engine_id, r.c.started >= since)
        ).scalar_one()
        if started < cap:
            return ""
        return (
            f"engine id started {started} runs in {self.runs_window:g} s "
            f"(--max-runs-per-engine {cap}); reuse the run id or retry later"
        )

    # -- events -------------------------------------------------------------------------------

    def _events(self, op: Events, batch: _Batch) -> EventsResult | SeqHole:
        run = self._run(op.run_key)
        if run.run_key in batch.fenced:
            run = self._fence(run, batch)
        hole = _hole(op.events, run.last_seq + 1)
        if hole is not None:
            return SeqHole(
                f"run {run.engine_id}/{run.run_id}: seq {hole} is not stored yet and no gap "
                f"declares it lost; events from seq {run.last_seq + 1} are needed first",
                run.last_seq + 1,
            )
        if run.partial:
            self._look_up_requests(run, op.events, batch)
        res = EventsResult(run.run_key, run.last_seq, 0, 0, [], [], {})
        for ev in op.events:
            seq = ev["seq"]
            if seq <= run.last_seq:
                res.duplicates += 1
                continue
            kind = ev.get("type")
            checked = type(ev) is CheckedEvent  # storage.frames checked its values
            why = "" if checked else ingest.integer_refusal(ev)
            try:
                if why:
                    raise ValueError(why)
                if kind == "step":
                    if checked:
                        ps = self._plain_step(run, ev, res, batch)
                        batch.steps.append(ps.row)
                        batch.plain.setdefault(run.run_key, (run, []))[1].append(ps)
                    else:
                        if run.run_key in batch.plain:  # its token times come first
                            self._stamp_plain(*batch.plain.pop(run.run_key), batch)
                        batch.steps.append(self._step(run, ev, batch))
                elif kind == "request":
                    batch.request_events.append(self._request(run, ev, batch, checked))
                elif kind == "control":
                    batch.controls.append(self._control(run, ev))
                elif kind == "gap":
                    batch.gaps.append(self._gap(run, ev))
                elif kind == "goodbye":
                    t_ns = ev.get("time_ns")
                    run.ended = run.wall(t_ns) if isinstance(t_ns, int) else time.time()
                    run.ended_without_goodbye = False
                else:
                    res.unknown_types.append(str(kind))
                    why = f"unknown event type {kind!r}"
                    if isinstance(ev.get("reason"), str):  # the engine's "unencodable" says why
                        why += f": {ev['reason']}"
                    batch.gaps.append(self._not_stored(run, ev, why))
                    kind = None
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
                why = f"{type(exc).__name__}: {exc}"
                res.bad.append((seq, why))
                batch.gaps.append(self._not_stored(run, ev, f"unreadable event: {why}"))
                kind = None
            if kind is not None:
                res.counts[kind] = res.counts.get(kind, 0) + 1
                res.stored += 1
            run.last_seq = seq
            run.num_events += 1
        run.last_seen = time.time()
        batch.dirty_runs[run.run_key] = run
        res.last_seq = run.last_seq
        return res

    def _lock_runs(self, ops: list[Any], batch: _Batch) -> None:
        """A shared store: lock the rows of the runs this batch stores events of, in one query
        and in key order (another collector writing one of them waits for this commit, and two
        such batches cannot deadlock), and note each run's durable seq (see ``_fence``)."""
        keys = sorted({op.run_key for op in ops if isinstance(op, Events)})
        if not keys:
            return
        r = schema.runs
        rows = self.conn.execute(
            select(r.c.id, r.c.last_seq).where(r.c.id.in_(keys)).order_by(r.c.id).with_for_update()
        )
        batch.fenced = {int(k): int(seq) for k, seq in rows}

    def _fence(self, run: RunState, batch: _Batch) -> RunState:
        """Reload the run when its durable seq in the store (locked by ``_lock_runs``) is not
        the one in memory (another collector stored its events since): the seqs of this batch
        are then judged against what is stored, never stored twice. Once per run and batch."""
        stored = batch.fenced.pop(run.run_key)
        if stored == run.last_seq:
            return run
        logger.info(
            "run %s/%s: durable seq %d in the store, %d here (another collector stored it): "
            "reloading",
            run.engine_id,
            run.run_id,
            stored,
            run.last_seq,
        )
        del self._runs[run.run_key]
        fresh = self._run(run.run_key)
        batch.dirty_requests.pop(run.run_key, None)
        return fresh

    def _look_up_batch(self, ops: list[Any], batch: _Batch) -> None:
        """``_look_up_requests`` for every ``Events`` op of the batch whose run is in memory,
        one query per run (not one per op: a frame of an engine at a high rate names new
        requests most times). After ``_lock_runs``: no other collector stores these runs'
        requests until the commit."""
        wanted: dict[int, list[dict[str, Any]]] = {}
        for op in ops:
            if isinstance(op, Events):
                run = self._runs.get(op.run_key)
                if run is not None and run.partial:
                    wanted.setdefault(op.run_key, []).extend(op.events)
        for run_key, events in wanted.items():
            self._look_up_requests(self._runs[run_key], events, batch)

    def _look_up_requests(self, run: RunState, events: list[dict[str, Any]], batch: _Batch) -> None:
        """Load, in one query per ``_LOOKUP_IDS`` ids, the requests that ``events``' request
        events name and memory does not hold (a new request's first event, most often), and
        note the ones the database does not hold either; ``_request_state`` then needs no query
        for them. A run with finished requests evicted would otherwise cost one query per new
        request."""
        known = run.requests
        absent = batch.not_stored.setdefault(run.run_key, set())
        ids = {
            rid
            for ev in events
            if ev.get("type") == "request"
            and type(rid := ev.get("request_id")) is str
            and rid not in known
            and rid not in absent
        }
        if not ids:
            return
        req = schema.requests
        wanted = sorted(ids)
        for i in range(0, len(wanted), _LOOKUP_IDS):
            part = wanted[i : i + _LOOKUP_IDS]
            rows = self.conn.execute(
                select(req).where(req.c.run_key == run.run_key, req.c.request_id.in_(part))
            )
            for row in rows:
                state = self._request_from_row(row._mapping)
                known[state.request_id] = state
            absent.update(rid for rid in part if rid not in known)

    def _request_state(self, run: RunState, request_id: str, batch: _Batch) -> RequestState:
        state = run.requests.get(request_id)
        if state is not None:
            return state
        if run.partial and request_id not in batch.not_stored.get(run.run_key, ()):
            req = schema.requests
            row = self.conn.execute(
                select(req).where(req.c.run_key == run.run_key, req.c.request_id == request_id)
            ).first()
            if row is not None:
                state = self._request_from_row(row._mapping)
                run.requests[request_id] = state
                return state
        state = RequestState(req_no=run.next_req_no, request_id=request_id)
        run.next_req_no += 1
        run.requests[request_id] = state
        batch.touch(run, state)
        return state

    def _step(self, run: RunState, ev: dict[str, Any], batch: _Batch) -> dict[str, Any]:
        raw_chunks = ev.get("chunks") or []
        if not isinstance(raw_chunks, list):
            raise TypeError("chunks must be a list")
        parsed: list[tuple[str, int, int, int]] = []
        for c in raw_chunks:  # one pass per chunk, checks inline
            rid = c["request_id"]
            if not isinstance(rid, str):
                raise TypeError(f"chunk request_id must be a string, got {rid!r}")
            flags = (
                (FLAG_DECODE if c["kind"] == "decode" else 0)
                | (FLAG_PRODUCED if c["produced_token"] else 0)
                | (FLAG_CAPPED if c.get("capped") else 0)  # absent from older engines
            )
            start, n = c["start"], c["num_tokens"]
            # what _int checks, inline for the common case; _int says why otherwise
            if type(start) is not int or not -INT64_MAX <= start <= INT64_MAX:
                start = _int(start, "start")
            if type(n) is not int or not -INT64_MAX <= n <= INT64_MAX:
                n = _int(n, "num_tokens")
            parsed.append((rid, start, n, flags))
        row = self._step_row(run, ev)
        self._step_chunks(run, row, parsed, batch)
        return row

    def _step_row(self, run: RunState, ev: dict[str, Any]) -> dict[str, Any]:
        """A step event's row but for its packed columns (nothing is changed yet)."""
        g = ev.get
        row: dict[str, Any] = {
            "run_key": run.run_key,
            "seq": ev["seq"],
            "step": _int(ev["step"], "step"),
            "start_ns": _int(ev["start_ns"], "start_ns"),
            "end_ns": _int(ev["end_ns"], "end_ns"),
            "token_budget": _opt_int(g("token_budget"), "token_budget"),
            "policy": _opt_str(g("policy")),
            "long_prefill_token_threshold": _opt_int(
                g("long_prefill_token_threshold"), "long_prefill_token_threshold"
            ),
        }
        for name in _STEP_INTS:
            row[name] = _opt_int(g(name), name)
        return row

    def _step_chunks(
        self,
        run: RunState,
        row: dict[str, Any],
        parsed: list[tuple[str, int, int, int]],
        batch: _Batch,
    ) -> None:
        """The step's chunks, one by one: their requests (made when new), their tokens' times,
        the run's step counters, and the row's packed columns (OverflowError for a value out of
        its packed field, after the rest)."""
        step, end_ns = row["step"], row["end_ns"]
        chunk_rows: list[tuple[int, int, int, int]] = []
        token_rows: list[tuple[int, int, int]] = []
        known = run.requests
        dirty: dict[int, RequestState] | None = None  # batch.touch's dict for this run
        for rid, start, n, flags in parsed:  # the hot loop of ingest's general path
            req = known.get(rid)
            if req is None:
                req = self._request_state(run, rid, batch)
            chunk_rows.append((req.req_no, start, n, flags))
            if flags & FLAG_PRODUCED:
                k = req.num_tokens + 1
                if k == 1 or req.last_token_ns is None:
                    itl = -1
                    req.first_token_ns = end_ns
                    req.first_token_step = step
                else:
                    itl = end_ns - req.last_token_ns
                    if not -INT64_MAX - 1 <= itl <= INT64_MAX:  # never into the request's row
                        raise OverflowError(_GAP_PAST_INT64)
                    if req.max_itl_ns is None or itl > req.max_itl_ns:
                        req.max_itl_ns = itl
                req.num_tokens = k
                req.last_token_ns = end_ns
                req.last_token_step = step
                token_rows.append((req.req_no, k, itl))
                if dirty is None:
                    dirty = batch.dirty_requests.setdefault(run.run_key, {})
                dirty[req.req_no] = req
        self._step_counted(run, row)
        row["num_chunks"] = len(chunk_rows)
        row["num_tokens_out"] = len(token_rows)
        row["chunks"] = pack_chunks(chunk_rows)
        row["tokens"] = pack_tokens(token_rows)

    @staticmethod
    def _step_counted(run: RunState, row: dict[str, Any]) -> None:
        run.num_steps += 1
        step = row["step"]
        if run.last_step is None or step >= run.last_step:
            run.last_step = step
            run.last_step_end_ns = row["end_ns"]
        if row["token_budget"] is not None:
            run.token_budget = row["token_budget"]
        if row["policy"] is not None:
            run.policy = row["policy"]

    def _plain_step(
        self, run: RunState, ev: dict[str, Any], res: EventsResult, batch: _Batch
    ) -> PlainStep:
        """A step event ``storage.frames`` decoded (checked): its row, and its chunks' requests
        (made when new, in chunk order as ``_step_chunks`` makes them); the rest waits for
        ``_stamp_plain``, once for all such steps of the run in the batch."""
        g = ev.get  # checked: its ints fit their columns, its policy is a string
        row: dict[str, Any] = {
            "run_key": run.run_key,
            "seq": ev["seq"],
            "step": ev["step"],
            "start_ns": ev["start_ns"],
            "end_ns": ev["end_ns"],
            "token_budget": g("token_budget"),
            "policy": g("policy"),
            "long_prefill_token_threshold": g("long_prefill_token_threshold"),
        }
        for name in _STEP_INTS:
            row[name] = g(name)
        chunks: list[Chunk] = ev["chunks"]
        known = run.requests
        rids: list[str] = list(map(_REQUEST_ID, chunks))
        reqs: list[RequestState | None] = list(map(known.get, rids))
        if None in reqs:
            for i, rid in enumerate(rids):
                req = reqs[i] or known.get(rid)  # a request new in this step may come again
                reqs[i] = req if req is not None else self._request_state(run, rid, batch)
        done = cast("list[RequestState]", reqs)
        return PlainStep(ev, row, chunks, done, row["step"], row["end_ns"], res)

    def _stamp_pending(self, batch: _Batch) -> None:
        for run, plain in batch.plain.values():
            self._stamp_plain(run, plain, batch)
        batch.plain.clear()

    def _stamp_plain(self, run: RunState, plain: list[PlainStep], batch: _Batch) -> None:
        """The packed columns and token times of a run's steps from ``storage.frames`` (in seq
        order, up to now in the batch), all at once; when a value does not fit its packed
        field, one by one as ``_step`` does (the step whose value does not fit becomes an
        unreadable event, as there). Nothing reads the token times of the run's requests
        before: a step of another kind, a hello or the end of the batch stamps them first."""
        dirty = batch.dirty_requests.setdefault(run.run_key, {})
        try:
            stamping.stamp(plain, dirty)
        except OverflowError:
            pass
        else:
            for ps in plain:
                self._step_counted(run, ps.row)
            return
        for ps in plain:
            parsed = [
                (
                    c.request_id,
                    c.start,
                    c.num_tokens,
                    (FLAG_DECODE if c.kind == "decode" else 0)
                    | (FLAG_PRODUCED if c.produced_token else 0)
                    | (FLAG_CAPPED if c.capped else 0),
                )
                for c in ps.chunks
            ]
            try:
                self._step_chunks(run, ps.row, parsed, batch)
            except OverflowError as exc:
                why = f"{type(exc).__name__}: {exc}"
                batch.steps[:] = [r for r in batch.steps if r is not ps.row]
                res = ps.result
                res.counts["step"] -= 1
                if not res.counts["step"]:
                    del res.counts["step"]
                res.stored -= 1
                res.bad.append((ps.row["seq"], why))
                res.bad.sort()
                batch.gaps.append(self._not_stored(run, ps.event, f"unreadable event: {why}"))

    def _request(
        self, run: RunState, ev: dict[str, Any], batch: _Batch, checked: bool = False
    ) -> dict[str, Any]:
        """``checked``: storage.frames decoded it (its ints fit, its texts are strings)."""
        rid = ev["request_id"]
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a string, got {rid!r}")
        kind = str(ev["kind"])
        g = ev.get
        if checked:
            time_ns, step = g("time_ns"), g("step")
            counts = {name: g(name) for name in _REQ_COUNTS}
            traffic_class, finish_reason = g("traffic_class"), g("finish_reason")
        else:
            time_ns = _opt_int(g("time_ns"), "time_ns")
            step = _opt_int(g("step"), "step")
            counts = {name: _opt_int(g(name), name) for name in _REQ_COUNTS}
            traffic_class = _opt_str(g("traffic_class"))
            finish_reason = _opt_str(g("finish_reason"))
        req = self._request_state(run, rid, batch)
        if traffic_class is not None:
            req.traffic_class = traffic_class
        for name, value in counts.items():
            if value is not None and value > getattr(req, name):
                setattr(req, name, value)
        if kind == "arrived":
            if req.arrival_ns is None:
                req.arrival_ns = time_ns
        elif kind == "first_scheduled":
            if req.first_scheduled_ns is None:
                req.first_scheduled_ns = time_ns
        elif kind in ("finished", "aborted"):
            req.finished_ns = time_ns
            req.finish_reason = finish_reason or ("abort" if kind == "aborted" else None)
        elif kind == "preempted":
            req.num_preemptions += 1
        batch.touch(run, req)
        return {
            "run_key": run.run_key,
            "seq": ev["seq"],
            "request_id": rid,
            "kind": kind,
            "time_ns": time_ns,
            "step": step,
            "traffic_class": traffic_class,
            "num_output_tokens": counts["num_output_tokens"],
            "finish_reason": finish_reason,
        }

    def _control(self, run: RunState, ev: dict[str, Any]) -> dict[str, Any]:
        time_ns = _opt_int(ev.get("time_ns"), "time_ns")
        accepted = bool(ev.get("accepted"))
        key = _opt_str(ev.get("key"))
        if accepted and key == "token_budget" and isinstance(ev.get("new_value"), int):
            run.token_budget = ev["new_value"]
        elif accepted and key == "policy" and ev.get("new_value") is not None:
            run.policy = str(ev["new_value"])
        return {
            "engine_id": run.engine_id,
            "run_id": run.run_id,
            "seq": ev["seq"],
            "time_ns": time_ns,
            "wall": run.wall(time_ns) if time_ns is not None else time.time(),
            "key": key,
            "old_value": _json_text(ev.get("old_value")),
            "new_value": _json_text(ev.get("new_value")),
            "accepted": accepted,
            "source": _opt_str(ev.get("source")),
            "applied_at_step": _opt_int(ev.get("applied_at_step"), "applied_at_step"),
            "reason": _opt_str(ev.get("reason")),
            "request_id": _opt_str(ev.get("request_id")),
        }

    def _gap(self, run: RunState, ev: dict[str, Any]) -> dict[str, Any]:
        time_ns = _opt_int(ev.get("time_ns"), "time_ns")
        row = {
            "run_key": run.run_key,
            "seq": ev["seq"],
            "first_seq_lost": _opt_int(ev.get("first_seq_lost"), "first_seq_lost"),
            "last_seq_lost": _opt_int(ev.get("last_seq_lost"), "last_seq_lost"),
            "num_events_lost": _opt_int(ev.get("num_events_lost"), "num_events_lost"),
            "reason": _opt_str(ev.get("reason")),
            "time_ns": time_ns,
            "wall": run.wall(time_ns) if time_ns is not None else time.time(),
        }
        run.num_gap_events += 1
        return row

    def _not_stored(self, run: RunState, ev: dict[str, Any], why: str) -> dict[str, Any]:
        """The gap row that records an event the store could not keep: its own seq, lost."""
        seq = ev["seq"]
        time_ns = ev.get("time_ns")
        if type(time_ns) is not int or not -INT64_MAX <= time_ns <= INT64_MAX:
            time_ns = None
        run.num_gap_events += 1
        return {
            "run_key": run.run_key,
            "seq": seq,
            "first_seq_lost": seq,
            "last_seq_lost": seq,
            "num_events_lost": 1,
            "reason": f"not stored by the collector: {why}"[: ingest.MAX_TEXT_CHARS],
            "time_ns": time_ns,
            "wall": run.wall(time_ns) if time_ns is not None else time.time(),
        }

    # -- flush --------------------------------------------------------------------------------

    def _append(self, table: Any, rows: list[dict[str, Any]]) -> None:
        """Insert ``rows`` (each with the same keys) into an append-only event table: on
        PostgreSQL with one COPY (no statement per row), elsewhere with one executemany."""
        if not self.copy:
            self.conn.execute(insert(table), rows)
            return
        cols = list(rows[0])
        get = operator.itemgetter(*cols)
        dbapi = self.conn.connection.driver_connection
        assert dbapi is not None
        with (
            dbapi.cursor() as cur,
            cur.copy(f"COPY {table.name} ({', '.join(cols)}) FROM STDIN (FORMAT BINARY)") as copy,
        ):
            # binary: a step's packed columns go as they are (text would write them in hex)
            copy.set_types([_pg_type(table, name) for name in cols])
            for row in rows:
                copy.write_row(get(row))

    def _update_requests(self, changed: list[tuple[int, RequestState]]) -> None:
        """PostgreSQL: update the ``(run_key, request)`` rows in one statement (their values
        as one array per column), not one statement per request."""
        reqs = [req for _, req in changed]
        arrays = [[key for key, _ in changed], [req.req_no for req in reqs]]
        arrays += [list(col) for col in zip(*map(_req_mutable, reqs), strict=True)]
        dbapi = self.conn.connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cur:
            cur.execute(_UPDATE_REQUESTS_PG, arrays)

    def _flush(self, batch: _Batch) -> None:
        conn = self.conn
        new_rows: list[dict[str, Any]] = []
        changed: list[tuple[int, RequestState]] = []
        for run_key, reqs in batch.dirty_requests.items():
            for req in reqs.values():
                if req.persisted:
                    changed.append((run_key, req))
                else:
                    new_rows.append(req.row(run_key))
        if new_rows:
            if self.copy:
                self._append(schema.requests, new_rows)
            else:
                conn.execute(insert(schema.requests), new_rows)
        if changed and self.copy:
            self._update_requests(changed)
        elif changed:
            upd_rows = []
            for run_key, req in changed:
                row = dict(zip(_REQ_MUTABLE, _req_mutable(req), strict=True))
                row.update(b_run_key=run_key, b_req_no=req.req_no)
                upd_rows.append(row)
            conn.execute(self._upd_requests, upd_rows)
        if batch.steps:
            self._append(schema.steps, batch.steps)
        if batch.request_events:
            self._append(schema.request_events, batch.request_events)
        if batch.controls:
            conn.execute(insert(schema.controls), batch.controls)
        if batch.gaps:
            conn.execute(insert(schema.gaps), batch.gaps)
        r = schema.runs
        dirty = list(batch.dirty_runs.values())
        if len(dirty) > 1 and self.db.dialect.supports_sane_multi_rowcount:
            # one statement for the batch's runs (one round trip on PostgreSQL's pipeline)
            rows = [{**run.row(), "b_id": run.run_key} for run in dirty]
            done = conn.execute(self._upd_runs, rows)
            if done.rowcount == len(rows):
                return
            dirty = [run for run in dirty if not self._run_exists(run.run_key)][:1]
        for run in dirty:
            done = conn.execute(update(r).where(r.c.id == run.run_key).values(**run.row()))
            if done.rowcount == 0:
                # deleted by a prune since it was read (SQLite reads outside the transaction):
                # roll the batch back; the retry reads the runs table again
                raise RunGone(f"run {run.engine_id}/{run.run_id} was deleted meanwhile (pruned)")

    def _run_exists(self, run_key: int) -> bool:
        r = schema.runs
        return self.conn.execute(select(r.c.id).where(r.c.id == run_key)).first() is not None
