"""The collector: engines stream events to ``/ingest``, control clients use ``/control``.

One asyncio event loop serves every connection; handlers parse and check frames and only
enqueue them (``storage.writer``); the writer thread commits in batches and the acks go out
after the commit. ``GET /healthz`` and ``GET /metrics`` answer on the same port
(``process_request``). The wire contract is docs/telemetry.md.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from storage import db as dbm
from storage import ingest, retention
from storage.ingest import CLOSE_BAD_INPUT
from storage.store import (
    CollectorControl,
    Disconnect,
    Events,
    EventsResult,
    Hello,
    RunInfo,
    SeqHole,
)
from storage.writer import DEFAULT_RETRY_DEADLINE, DEFAULT_STALL_AFTER, Writer
from wire import credentials
from wire.control import (
    CAP_KEY,
    CONTROL_KEYS,
    POLICIES,
    ControlRefused,
    check_changes,
    control_mac,
    relay_declaration,
    same_secret,
)
from wire.credentials import EngineCredentials

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8765
# The publisher sends at most 1 MiB per frame (a larger event as a placeholder): 4 MiB is room.
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 256
# Connections to /ingest that have not yet shown a credential (a valid publish token in the
# handshake's Authorization header, or an accepted hello): their own small pool, a few per peer
# address, and a short time to say hello, so that idle sockets never crowd engines or controls out.
DEFAULT_MAX_UNIDENTIFIED = 32
DEFAULT_MAX_UNIDENTIFIED_PER_PEER = 8
DEFAULT_HELLO_TIMEOUT = 3.0
# Of max_connections, this many (at most an eighth) only /control may take, and as many only
# /ingest connections with a credential may take.
RESERVED_CONNECTIONS = 16
# How long a run that left without a goodbye keeps its engine id's control route: its engine
# reconnects within seconds (the publisher's backoff is at most 3 s); an engine restarted after a
# crash is a new run, and gets the route when this is over.
DEFAULT_ROUTE_GRACE = 60.0
MAX_QUEUED_FRAMES = 16  # frames read ahead per connection (websockets' max_queue)
MAX_CONTROLS_IN_FLIGHT = 16  # per /control client

CLOSE_TOO_BIG = 1009
CLOSE_AUTH = 4401
CLOSE_NOT_YOURS = 4403  # the hello cannot speak for the run it names (wrong run_secret)
CLOSE_REPLACED = 4409
CLOSE_STORE_ERROR = 1011


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


@dataclass(eq=False)
class _Slot:
    """One admitted /ingest or /control connection, as the connection limits count it."""

    kind: str  # "control", "ingest" (with a credential) or "unidentified"
    peer: str


def presented_token(request: Request) -> str | None:
    """The token a /control client presented: ``Authorization: Bearer`` over ``?token=``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return parse_qs(request.path.partition("?")[2]).get("token", [None])[0]


@dataclass
class CollectorConfig:
    db_url: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # Credentials (wire/credentials.py): engines present publish_token in their hello; control
    # clients present control_token when they connect to /control (or in each control message).
    # auth_token is the one token of older releases: it stands in for whichever is not set.
    publish_token: str | None = None
    control_token: str | None = None
    auth_token: str | None = None
    # engine id -> its own tokens (--credentials-file; wire.credentials): a listed engine
    # publishes and is steered only with its own, the others with the shared ones above
    engine_credentials: dict[str, EngineCredentials] = field(default_factory=dict, repr=False)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    control_timeout: float = 15.0
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT  # a new /ingest connection's time to say hello
    # how long a hello waits for the store to register its run (then: close 1011, retry)
    hello_answer_timeout: float = 10.0
    # the writer's op-by-op retries of a failed batch stop after this many seconds in all
    store_retry_deadline: float = DEFAULT_RETRY_DEADLINE
    # /healthz answers 503 once a batch has waited on the store this long
    store_stall_after: float = DEFAULT_STALL_AFTER
    max_pending_events: int = 200_000
    # an engine id's control route stays with the run that held it this long after that run's
    # connection dropped without a goodbye (and after the collector's start, for the run that
    # was connected when it stopped): no other run of the id takes it meanwhile
    route_grace: float = DEFAULT_ROUTE_GRACE
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # /ingest and /control together
    max_unidentified: int = DEFAULT_MAX_UNIDENTIFIED  # /ingest before a credential, in all
    max_unidentified_per_peer: int = DEFAULT_MAX_UNIDENTIFIED_PER_PEER  # ... from one address
    db_connect_timeout: float | None = None  # PostgreSQL; None: storage.db's default
    db_statement_timeout: float | None = None
    # retention (storage.retention): a pass every retention_interval seconds on its own thread
    prune_older_than: float | None = None  # seconds
    prune_max_bytes: int | None = None
    retention_interval: float = 60.0
    prune_max_rows: int = 50_000  # rows deleted per pass at most

    @property
    def ingest_token(self) -> str | None:
        """What a hello must carry (None: nothing)."""
        return self.publish_token or self.auth_token

    def control_gate(self) -> tuple[str, ...]:
        """The tokens that open a /control connection (empty: open). The legacy auth token
        opens it beside a control token, as before; steering then still needs the control
        token in each message. Each listed engine's own control token opens it too (it then
        lists and steers that engine only)."""
        shared = tuple(t for t in (self.control_token, self.auth_token) if t)
        if not shared:
            return ()
        return shared + tuple(c.control for c in self.engine_credentials.values())

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be from 0 to 65535, got {self.port}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be at least 1024, got {self.max_frame_bytes}")
        if self.control_timeout <= 0:
            raise ValueError(f"control_timeout must be positive, got {self.control_timeout}")
        if not self.route_grace >= 0:
            raise ValueError(f"route_grace must be 0 or more, got {self.route_grace}")
        for name in (
            "hello_answer_timeout",
            "store_retry_deadline",
            "store_stall_after",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.hello_timeout > 0:
            raise ValueError(f"hello_timeout must be positive, got {self.hello_timeout}")
        for name in ("max_connections", "max_unidentified", "max_unidentified_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        clash = credentials.clash_with_shared(
            self.engine_credentials, (self.publish_token, self.control_token, self.auth_token)
        )
        if clash:
            raise ValueError(clash)
        if self.prune_older_than is not None and not self.prune_older_than > 0:
            raise ValueError(f"prune_older_than must be positive, got {self.prune_older_than}")
        if self.prune_max_bytes is not None and not self.prune_max_bytes > 0:
            raise ValueError(f"prune_max_bytes must be positive, got {self.prune_max_bytes}")
        if not self.retention_interval > 0:
            raise ValueError(f"retention_interval must be positive, got {self.retention_interval}")
        if self.prune_max_rows < 1:
            raise ValueError(f"prune_max_rows must be at least 1, got {self.prune_max_rows}")

    @property
    def reserved(self) -> int:
        """Slots kept for /control, and as many for /ingest with a credential."""
        return min(RESERVED_CONNECTIONS, self.max_connections // 8)

    def publish_tokens(self) -> tuple[str, ...]:
        """The tokens that identify an /ingest connection in its handshake (empty: none)."""
        shared = (self.ingest_token,) if self.ingest_token else ()
        return shared + tuple(c.publish for c in self.engine_credentials.values())


class Metrics:
    """The collector's own Prometheus registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.frames = Counter("collector_frames", "Frames received on /ingest", registry=r)
        self.events = Counter("collector_events", "Events stored, by type", ["type"], registry=r)
        self.duplicates = Counter(
            "collector_duplicate_events", "Resent events already stored (skipped)", registry=r
        )
        self.refusals = Counter(
            "collector_refusals",
            "Frames, events or controls refused, by reason",
            ["reason"],
            registry=r,
        )
        self.ingest_lag = Gauge(
            "collector_ingest_lag_seconds",
            "Receipt of a frame to its commit, for the latest batch (oldest frame in it)",
            registry=r,
        )
        self.ingest_lag_hist = Histogram(
            "collector_ingest_lag_hist_seconds",
            "Receipt of a frame to its commit",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.batch_seconds = Histogram(
            "collector_write_batch_seconds",
            "Time to write and commit one batch",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.batch_events = Histogram(
            "collector_write_batch_events",
            "Events per committed batch",
            registry=r,
            buckets=(1, 10, 100, 1000, 5000, 20000, 50000),
        )
        self.pending = Gauge(
            "collector_pending_events", "Events received but not yet committed", registry=r
        )
        self.connected = Gauge(
            "collector_connected_engines", "Engines connected on /ingest", registry=r
        )
        self.control_clients = Gauge(
            "collector_control_clients", "Clients connected on /control", registry=r
        )
        self.controls = Counter(
            "collector_controls", "Controls relayed, by outcome", ["outcome"], registry=r
        )
        self.store_size = Gauge(
            "collector_store_size_bytes",
            "Store size the retention limits count (SQLite: pages in use; PostgreSQL: the "
            "tables' total relation size), measured every retention interval",
            registry=r,
        )
        self.store_file_size = Gauge(
            "collector_store_file_size_bytes",
            "Store size on disk (SQLite: database file and WAL; PostgreSQL: as store_size)",
            registry=r,
        )
        self.pruned_rows = Counter(
            "collector_pruned_rows", "Rows deleted by the retention limits", registry=r
        )
        self.pruned_runs = Counter(
            "collector_pruned_runs", "Whole runs deleted by the retention limits", registry=r
        )

    def refuse(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()


@dataclass(eq=False)
class IngestConn:
    """One engine connection on /ingest (after its hello)."""

    ws: ServerConnection
    engine_id: str
    run_id: str
    run_key: int = 0
    expected: int = 1  # the next seq this connection may send
    max_token_budget: int | None = None
    token_budget: int | None = None
    policy: str | None = None
    long_prefill_token_threshold: int | None = None  # None: an engine older than the cap
    policies: tuple[str, ...] = POLICIES
    model: str | None = None
    engine_kind: str | None = None  # the hello's engine_kind ("vllm" for the vLLM bridge)
    last_step: int | None = None
    last_seen_ns: int | None = None
    # the first step of the latest accepted control (its ack or its event): a step event of an
    # earlier step, arriving later (telemetry is batched, an ack is not), ran the old settings
    # and must not put them back in this row
    settings_from_step: int | None = None
    current: bool = True  # False once replaced by a newer connection of the same run
    said_goodbye: bool = False  # its run's goodbye was accepted: the run will not be back
    # True from the first of its frames the store could not take: nothing more is accepted
    # from it and it is closed, so the engine reconnects and resends from the durable seq
    failed: bool = False
    pending: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    # control id -> (source, reason) its /control client declared, stamped on the engine's
    # control events with that id as they are stored (the newest MAX_DECLARED kept)
    declared: OrderedDict[str, tuple[str, str | None]] = field(default_factory=OrderedDict)


MAX_DECLARED = 64  # per engine connection: relayed controls whose events are still to come


def _note_applied(conn: IngestConn, step: Any) -> None:
    """An accepted control is in force from ``step`` (its ``applied_at_step``)."""
    if isinstance(step, int) and not isinstance(step, bool):
        conn.settings_from_step = max(step, conn.settings_from_step or step)


def _before(step: Any, settings_from_step: int | None) -> bool:
    """A step event that ran before the latest accepted control came in force."""
    return isinstance(step, int) and settings_from_step is not None and step < settings_from_step


def _stamp_declared(
    declared: OrderedDict[str, tuple[str, str | None]], events: list[dict[str, Any]]
) -> None:
    """Give the engine's control events for a relayed control the source (and, on an accepted
    change, the reason) its /control client declared."""
    for ev in events:
        if ev.get("type") != "control":
            continue
        got = declared.get(str(ev.get("request_id")))
        if got is None:
            continue
        ev["source"] = got[0]
        if got[1] is not None and ev.get("accepted"):
            ev["reason"] = ingest.clean_text(got[1])


def _peer(connection: ServerConnection) -> str:
    """The peer's address without its port ("" when unknown)."""
    addr = connection.remote_address
    return str(addr[0]) if isinstance(addr, tuple) and addr else ""


class Collector:
    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self._server: Server | None = None
        self._writer: Writer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._by_run: dict[int, IngestConn] = {}
        self._by_engine: dict[str, IngestConn] = {}
        # engine id -> the run whose route it is while that run is away within its reconnection
        # grace: (run key, run id, monotonic deadline); nobody else's controls route meanwhile
        self._route_kept: dict[str, tuple[int, str, float]] = {}
        self._seen: dict[str, dict[str, Any]] = {}  # engine_id -> its latest list_engines row
        self._pending_events = 0
        self._drained = asyncio.Event()
        self._ids = itertools.count(1)
        # (engine_id, run_id) -> hellos submitted to the writer and not answered yet, and the
        # run key whose Disconnect waits for them (see _disconnected)
        self._hellos_pending: dict[tuple[str, str], int] = {}
        self._deferred_disconnect: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # admitted /ingest and /control connections (see _admit), and their counts
        self._slots: dict[ServerConnection, _Slot] = {}
        self._n_conns = 0
        self._n_control = 0
        self._n_unidentified = 0
        self._unidentified_by_peer: dict[str, int] = {}
        self._retention: threading.Thread | None = None
        self._retention_stop = threading.Event()

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Migrate the store, start the writer, listen. Raises (having cleaned up) when the
        store cannot be opened or the port cannot be bound."""
        self._loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()
        db = dbm.connect(
            self.config.db_url,
            connect_timeout=self.config.db_connect_timeout,
            statement_timeout=self.config.db_statement_timeout,
        )
        await asyncio.to_thread(dbm.migrate, db)
        self._keeper = retention.Keeper(
            db,
            older_than_s=self.config.prune_older_than,
            max_bytes=self.config.prune_max_bytes,
            max_rows=self.config.prune_max_rows,
        )
        # the runs the store's startup marks ended without goodbye keep a grace from now
        await asyncio.to_thread(self._keeper.note_restart)
        # each engine id's route waits for the run that was connected (or reconnecting) when
        # the collector stopped, as for a run whose connection dropped
        now, wall, grace = time.monotonic(), time.time(), self.config.route_grace
        self._route_kept = {}
        for engine_id, (run_key, run_id, last) in self._keeper.runs_at_restart.items():
            left = grace if last is None else min(grace, last + grace - wall)
            if left > 0:
                self._route_kept[engine_id] = (run_key, run_id, now + left)
        self._writer = Writer(
            db,
            self._on_commit_threadsafe,
            retry_deadline=self.config.store_retry_deadline,
            stall_after=self.config.store_stall_after,
        )
        await asyncio.to_thread(self._writer.start)
        try:
            self._server = await serve(
                self._handle,
                self.config.host,
                self.config.port,
                process_request=self._process_request,
                max_size=self.config.max_frame_bytes,
                max_queue=MAX_QUEUED_FRAMES,
                compression=None,
                ping_interval=20,
                ping_timeout=60,
            )
        except BaseException:
            await asyncio.to_thread(self._writer.stop)
            self._writer = None
            raise
        store = db.url.render_as_string(hide_password=True)
        logger.info("serving on %s, store %s", self.url, store)
        self._retention_stop.clear()
        self._retention = threading.Thread(
            target=self._retention_loop, name="storage-retention", daemon=True
        )
        self._retention.start()

    @property
    def port(self) -> int:
        assert self._server is not None, "collector not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"ws://{host}:{self.port}"

    async def serve_forever(self) -> None:
        assert self._server is not None
        await self._server.serve_forever()

    async def stop(self) -> None:
        """Close every connection, write what is queued, close the store."""
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        self._retention_stop.set()
        if self._retention is not None:
            await asyncio.to_thread(self._retention.join, 30)
            self._retention = None
        if self._writer is not None:
            await asyncio.to_thread(self._writer.stop)
            self._writer = None

    def _retention_loop(self) -> None:
        """Measure the store (and prune it, when limits are set) now and every interval: on
        this thread, never on the event loop or the writer's; each pass bounded."""
        while True:
            try:
                result = self._keeper.run_once()
                if result is not None:
                    self.metrics.pruned_rows.inc(result.rows_deleted)
                    self.metrics.pruned_runs.inc(result.runs_deleted)
                if self._keeper.size is not None:
                    self.metrics.store_size.set(self._keeper.size.used_bytes)
                    self.metrics.store_file_size.set(self._keeper.size.file_bytes)
            except Exception:
                logger.exception("retention pass failed (tried again next interval)")
            if self._retention_stop.wait(self.config.retention_interval):
                return

    # -- HTTP ---------------------------------------------------------------------------------

    def store_problem(self) -> str:
        """Why the store is not healthy ("" when it is): the writer stopped, its latest batch
        failed (until one commits again), or the batch it is writing has waited on the store
        over ``store_stall_after`` seconds."""
        writer = self._writer
        if writer is None or not writer.alive:
            return "the writer is not running"
        return writer.problem()

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        if path == "/healthz":
            why = self.store_problem()
            if why:
                return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"store: {why}\n")
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/metrics":
            response = connection.respond(HTTPStatus.OK, "")
            body = generate_latest(self.metrics.registry)
            response.body = body
            del response.headers["Content-Type"]
            del response.headers["Content-Length"]
            response.headers["Content-Type"] = CONTENT_TYPE_LATEST
            response.headers["Content-Length"] = str(len(body))
            return response
        if path not in ("/ingest", "/control"):
            return connection.respond(
                HTTPStatus.NOT_FOUND, "not found: use /ingest, /control, /healthz or /metrics\n"
            )
        gate = self.config.control_gate()
        if path == "/control" and gate:
            token = presented_token(request)
            if not any(same_secret(token, t) for t in gate):
                self.metrics.refuse("auth")
                return connection.respond(
                    HTTPStatus.UNAUTHORIZED,
                    "missing or wrong token: /control needs the collector's --control-token as "
                    "'Authorization: Bearer <token>' or ?token=\n",
                )
        kind = "control" if path == "/control" else "unidentified"
        tokens = self.config.publish_tokens() if path == "/ingest" else ()
        presented = bearer(request) if tokens else None
        if presented is not None:
            if not any(same_secret(presented, t) for t in tokens):
                self.metrics.refuse("auth")
                return connection.respond(
                    HTTPStatus.UNAUTHORIZED, "wrong publish token in the Authorization header\n"
                )
            kind = "ingest"
        return self._admit(connection, kind)

    def _admit(self, connection: ServerConnection, kind: str) -> Response | None:
        """Count a new connection against the limits (None: admitted), or the 503 that refuses
        it. Two invariants keep the reserves: /control and connections without a credential yet
        together leave ``reserved`` slots to /ingest connections with one, and those together
        with the ones without a credential leave as many to /control; the ones without a
        credential also have their own small pool, and a share of it per peer address."""
        cfg = self.config
        n, reserved = cfg.max_connections, cfg.reserved
        total, control, unidentified = self._n_conns, self._n_control, self._n_unidentified
        engines = total - control - unidentified  # /ingest with a credential
        peer = _peer(connection)
        full = f"too many connections (at most {n})"
        if total >= n:
            why = full
        elif kind == "control":
            why = "" if control + unidentified < n - reserved else full
        elif kind == "ingest":
            why = "" if engines + unidentified < n - reserved else full
        elif unidentified >= cfg.max_unidentified:
            why = f"too many connections without a hello yet (at most {cfg.max_unidentified})"
        elif self._unidentified_by_peer.get(peer, 0) >= cfg.max_unidentified_per_peer:
            why = (
                "too many connections without a hello yet from this address (at most "
                f"{cfg.max_unidentified_per_peer})"
            )
        elif control + unidentified >= n - reserved or engines + unidentified >= n - reserved:
            why = full
        else:
            why = ""
        if why:
            self.metrics.refuse(
                "too_many_unidentified" if "hello" in why else "too_many_connections"
            )
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, why + "\n")
        slot = _Slot(kind, peer)
        self._slots[connection] = slot
        self._n_conns += 1
        if kind == "control":
            self._n_control += 1
        elif kind == "unidentified":
            self._n_unidentified += 1
            self._unidentified_by_peer[peer] = self._unidentified_by_peer.get(peer, 0) + 1
        # the slot is freed when the handler ends, or when the connection closes should the
        # handshake fail before any handler runs
        self._spawn(self._release_when_closed(connection))
        return None

    def _identified(self, connection: ServerConnection) -> None:
        """An unidentified /ingest connection showed its credential: it leaves the small pool."""
        slot = self._slots.get(connection)
        if slot is None or slot.kind != "unidentified":
            return
        slot.kind = "ingest"
        self._forget_unidentified(slot.peer)

    def _forget_unidentified(self, peer: str) -> None:
        self._n_unidentified -= 1
        left = self._unidentified_by_peer.get(peer, 0) - 1
        if left > 0:
            self._unidentified_by_peer[peer] = left
        else:
            self._unidentified_by_peer.pop(peer, None)

    def _release(self, connection: ServerConnection) -> None:
        slot = self._slots.pop(connection, None)
        if slot is None:
            return
        self._n_conns -= 1
        if slot.kind == "control":
            self._n_control -= 1
        elif slot.kind == "unidentified":
            self._forget_unidentified(slot.peer)

    async def _release_when_closed(self, connection: ServerConnection) -> None:
        try:
            await connection.wait_closed()
        finally:
            self._release(connection)

    async def _handle(self, ws: ServerConnection) -> None:
        path = ws.request.path.partition("?")[0] if ws.request else ""
        try:
            if path == "/control":
                await self._control_client(ws)
            else:
                await self._ingest(ws)
        finally:
            self._release(ws)

    # -- writer plumbing ----------------------------------------------------------------------

    def _submit(self, op: Any, *, want_result: bool = False) -> asyncio.Future[Any] | None:
        assert self._writer is not None and self._loop is not None
        fut = None
        if want_result:
            fut = self._loop.create_future()
            self._futures[id(op)] = fut
        if isinstance(op, Events):
            self._pending_events += len(op.events)
            self.metrics.pending.set(self._pending_events)
        self._writer.submit(op)
        return fut

    def _on_commit_threadsafe(self, ops: list[Any], results: list[Any], seconds: float) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._on_commit, ops, results, seconds)

    def _on_commit(self, ops: list[Any], results: list[Any], seconds: float) -> None:
        m = self.metrics
        m.batch_seconds.observe(seconds)
        now = time.monotonic()
        acks: dict[int, tuple[IngestConn, int]] = {}
        n_events = 0
        oldest = None
        for op, result in zip(ops, results, strict=True):
            fut = self._futures.pop(id(op), None)
            if fut is not None and not fut.done():
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
            if not isinstance(op, Events):
                continue
            n_events += len(op.events)
            self._pending_events -= len(op.events)
            oldest = op.received if oldest is None else min(oldest, op.received)
            conn: IngestConn | None = op.tag
            if isinstance(result, BaseException):
                m.refuse("seq_hole" if isinstance(result, SeqHole) else "store_error")
                if conn is not None and not conn.failed:
                    self._fence(conn, result)
                continue
            self._count(result)
            if conn is not None:
                acks[id(conn)] = (conn, result.last_seq)
                self._report(conn, result)
        m.batch_events.observe(n_events)
        if oldest is not None:
            lag = now - oldest
            m.ingest_lag.set(lag)
            m.ingest_lag_hist.observe(lag)
        m.pending.set(self._pending_events)
        if self._pending_events <= self.config.max_pending_events:
            self._drained.set()
        for conn, seq in acks.values():
            self._spawn(self._send(conn.ws, {"type": "ack", "seq": seq}))

    def _fence(self, conn: IngestConn, exc: BaseException) -> None:
        """The store could not take a frame of ``conn``: accept nothing more from it (frames
        already queued behind it are refused by the store, which never stores past a seq it
        did not store) and close it; the engine reconnects and resends from the durable seq."""
        conn.failed = True
        logger.warning(
            "engine %s run %s: events not stored (%s: %s); closing, the engine resends from "
            "the durable seq",
            conn.engine_id,
            conn.run_id,
            type(exc).__name__,
            str(exc)[:200],
        )
        self._spawn(conn.ws.close(CLOSE_STORE_ERROR, "store error; resend"))

    def _count(self, result: EventsResult) -> None:
        m = self.metrics
        for kind, n in result.counts.items():
            m.events.labels(type=kind).inc(n)
        if result.duplicates:
            m.duplicates.inc(result.duplicates)
        for _ in result.unknown_types:
            m.refuse("unknown_event_type")
        for _ in result.bad:
            m.refuse("bad_event")

    def _report(self, conn: IngestConn, result: EventsResult) -> None:
        if result.unknown_types:
            types = sorted(set(result.unknown_types))
            self._spawn(
                self._send(
                    conn.ws,
                    {
                        "type": "error",
                        "code": "unknown_event_type",
                        "message": f"skipped {len(result.unknown_types)} event(s) of unknown "
                        f"type {types} (their seqs count as received)",
                    },
                )
            )
        if result.bad:
            # One reply per batch, however many of its events were bad.
            self._spawn(self._send(conn.ws, ingest.bad_events_reply(result.bad)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _send(ws: ServerConnection, msg: dict[str, Any]) -> None:
        try:
            await ws.send(json.dumps(msg, allow_nan=False))
        except ConnectionClosed:
            pass

    async def _backpressure(self) -> None:
        while self._pending_events > self.config.max_pending_events:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), 1.0)
            except TimeoutError:
                pass

    # -- /ingest ------------------------------------------------------------------------------

    async def _close(self, ws: ServerConnection, code: int, reason: str) -> None:
        self.metrics.refuse({CLOSE_BAD_INPUT: "bad_input", CLOSE_AUTH: "auth"}.get(code, str(code)))
        logger.warning("closing %s with %d: %s", ws.remote_address, code, reason)
        await ws.close(code, reason[:120])

    async def _ingest(self, ws: ServerConnection) -> None:
        try:
            raw = await asyncio.wait_for(ws.recv(), self.config.hello_timeout)
        except TimeoutError:
            self._release(ws)  # its slot is free at once, not after the closing handshake
            await self._close(ws, CLOSE_BAD_INPUT, "no hello within the time limit")
            return
        except ConnectionClosed as exc:
            self._closed_reason(exc)
            return
        self.metrics.frames.inc()
        hello, why = ingest.check_hello_frame(raw)
        if hello is None:
            self._release(ws)
            await self._close(ws, CLOSE_BAD_INPUT, why)
            return
        why = credentials.may_publish(
            hello["engine_id"],
            hello.get("token"),
            shared=self.config.ingest_token,
            engines=self.config.engine_credentials,
        )
        if why:
            self._release(ws)
            await self._close(ws, CLOSE_AUTH, why)
            return
        self._identified(ws)
        conn = IngestConn(ws=ws, engine_id=hello["engine_id"], run_id=hello["run_id"])
        self._take_hello(conn, hello)
        key = (conn.engine_id, conn.run_id)
        self._hellos_pending[key] = self._hellos_pending.get(key, 0) + 1
        failed: Exception | None = None
        fut = self._submit(Hello(hello), want_result=True)
        assert fut is not None
        try:
            info: RunInfo = await asyncio.wait_for(
                asyncio.shield(fut), self.config.hello_answer_timeout
            )
        except TimeoutError:
            # The store has not answered: the engine retries. The hello stays queued in the
            # writer; its late answer must not leave the run marked connected (_late_hello).
            fut.add_done_callback(lambda f: self._late_hello(key, f))
            logger.error(
                "registering run %s/%s: no answer from the store within %g s",
                conn.engine_id,
                conn.run_id,
                self.config.hello_answer_timeout,
            )
            await ws.close(CLOSE_STORE_ERROR, "store busy; retry")
            return
        except Exception as exc:
            failed = exc
            self._hello_answered(key)
        else:
            self._hello_answered(key)
        if failed is not None:
            logger.error(
                "registering run %s/%s failed: %s: %s",
                conn.engine_id,
                conn.run_id,
                type(failed).__name__,
                str(failed)[:200],
            )
            self._settle_disconnect(key)
            await ws.close(CLOSE_STORE_ERROR, f"store error: {type(failed).__name__}")
            return
        if info.refused:
            self._settle_disconnect(key)
            await self._close(ws, CLOSE_NOT_YOURS, info.refused)
            return
        prev = self._by_run.get(info.run_key)
        if not ingest.may_take_over(proven=info.proven, live=prev is not None and prev.current):
            self._settle_disconnect(key)
            await self._close(
                ws,
                CLOSE_REPLACED,
                "this run is live on another connection and the hello has no run_secret to "
                "prove it is the same engine; retry once that connection is gone",
            )
            return
        conn.run_key = info.run_key
        conn.expected = info.last_seq + 1
        if prev is not None:
            # The run's newer, proven connection takes over at once: the old one stops enqueueing.
            prev.current = False
            self._spawn(prev.ws.close(CLOSE_REPLACED, "replaced by a newer connection of this run"))
        self._by_run[info.run_key] = conn
        self._deferred_disconnect.pop(key, None)  # this hello marked the run connected again
        self._expire_kept_routes()
        route = self._by_engine.get(conn.engine_id)
        kept = self._route_kept.get(conn.engine_id)
        if kept is not None and kept[0] == conn.run_key:
            del self._route_kept[conn.engine_id]  # the run that held the route is back
            kept = None
        if route is None and kept is not None:
            logger.warning(
                "engine id %s: run %s connected while the control route is kept for run %s, "
                "which left without a goodbye (up to %g s for it to come back); controls that "
                "name no run_id go nowhere meanwhile",
                conn.engine_id,
                conn.run_id,
                kept[1],
                self.config.route_grace,
            )
        elif route is None or route is prev or route.run_key == conn.run_key:
            self._by_engine[conn.engine_id] = conn
        else:
            # Another run of this engine id is live (two engines started with one --engine-id,
            # or one posing as the other): the control route stays with the first.
            logger.warning(
                "engine id %s: run %s connected while run %s is live; controls stay routed to "
                "%s (a control may name its run_id)",
                conn.engine_id,
                conn.run_id,
                route.run_id,
                route.run_id,
            )
        if self._by_engine.get(conn.engine_id) is conn:
            self._refresh_seen(conn, connected=True)
        self.metrics.connected.set(len(self._by_run))
        logger.info(
            "engine %s run %s connected from %s (durable seq %d)",
            conn.engine_id,
            conn.run_id,
            ws.remote_address,
            info.last_seq,
        )
        try:
            await ws.send(json.dumps({"type": "ack", "seq": info.last_seq}))
            async for raw in ws:
                self.metrics.frames.inc()
                if not await self._ingest_frame(conn, raw):
                    return
        except ConnectionClosed as exc:
            self._closed_reason(exc)
        finally:
            self._disconnected(conn)

    def _closed_reason(self, exc: ConnectionClosed) -> None:
        if exc.sent is not None and exc.sent.code == CLOSE_TOO_BIG:
            self.metrics.refuse("frame_too_big")

    def _drop(self, conn: IngestConn) -> None:
        """Take ``conn`` off its engine id's control route. A run that said goodbye leaves it to
        another live run of the same engine id, if any; one that left without a goodbye keeps
        it for its reconnection grace (it is reconnecting, and only it can prove its run)."""
        if self._by_engine.get(conn.engine_id) is not conn:
            return
        del self._by_engine[conn.engine_id]
        if conn.said_goodbye or self.config.route_grace <= 0:
            self._pass_route(conn.engine_id)
        else:
            self._route_kept[conn.engine_id] = (
                conn.run_key,
                conn.run_id,
                time.monotonic() + self.config.route_grace,
            )

    def _pass_route(self, engine_id: str) -> None:
        """The route of ``engine_id`` to one of its live runs, if any."""
        for other in self._by_run.values():
            if other.engine_id == engine_id and other.current:
                self._by_engine[engine_id] = other
                self._refresh_seen(other, connected=True)
                return

    def _expire_kept_routes(self) -> None:
        """Routes kept for runs whose grace is over pass to a live run of their engine id."""
        if not self._route_kept:
            return
        now = time.monotonic()
        for engine_id, (_, _, until) in list(self._route_kept.items()):
            if until <= now:
                del self._route_kept[engine_id]
                if engine_id not in self._by_engine:
                    self._pass_route(engine_id)

    def _live(self, engine_id: str, run_id: str) -> IngestConn | None:
        for conn in self._by_run.values():
            if conn.engine_id == engine_id and conn.run_id == run_id and conn.current:
                return conn
        return None

    def _disconnected(self, conn: IngestConn) -> None:
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_result(
                    {"ok": False, "error": f"engine {conn.engine_id} disconnected before answering"}
                )
        conn.pending.clear()
        if self._by_run.get(conn.run_key) is conn:
            del self._by_run[conn.run_key]
            if conn.current and conn.run_key:
                key = (conn.engine_id, conn.run_id)
                if self._hellos_pending.get(key):
                    # A newer hello of this run is queued in the writer (the engine gave up on
                    # this connection's): a Disconnect now would land after it and mark the new
                    # connection's run disconnected. Its answer decides (_settle_disconnect).
                    self._deferred_disconnect[key] = conn.run_key
                else:
                    self._submit(Disconnect(conn.run_key))
            if self._seen.get(conn.engine_id, {}).get("run_id") == conn.run_id:
                self._refresh_seen(conn, connected=False)
        self._drop(conn)
        self.metrics.connected.set(len(self._by_run))
        logger.info(
            "engine %s run %s disconnected (code %s)",
            conn.engine_id,
            conn.run_id,
            conn.ws.close_code,
        )

    def _hello_answered(self, key: tuple[str, str]) -> None:
        n = self._hellos_pending.get(key, 0) - 1
        if n > 0:
            self._hellos_pending[key] = n
        else:
            self._hellos_pending.pop(key, None)

    def _late_hello(self, key: tuple[str, str], fut: asyncio.Future[Any]) -> None:
        """The store answered a hello whose connection gave up waiting: a run it marked
        connected has no connection, unless a newer one of the run is live or on its way."""
        self._hello_answered(key)
        info = None if fut.cancelled() or fut.exception() is not None else fut.result()
        if isinstance(info, RunInfo) and not info.refused and info.run_key not in self._by_run:
            self._deferred_disconnect.setdefault(key, info.run_key)
        self._settle_disconnect(key)

    def _settle_disconnect(self, key: tuple[str, str]) -> None:
        """A hello of ``key`` was answered without registering a connection: the Disconnect that
        waited for it goes to the writer now, unless another hello is still on its way or the
        run is live again."""
        run_key = self._deferred_disconnect.get(key)
        if run_key is None or self._hellos_pending.get(key):
            return
        del self._deferred_disconnect[key]
        if run_key not in self._by_run:
            self._submit(Disconnect(run_key))

    def _take_hello(self, conn: IngestConn, h: dict[str, Any]) -> None:
        conn.max_token_budget = h.get("max_token_budget")
        conn.token_budget = h.get("token_budget")
        conn.policy = h.get("policy")
        conn.long_prefill_token_threshold = h.get(CAP_KEY)
        conn.model = h.get("model")
        policies = h.get("policies")
        if isinstance(policies, list) and all(isinstance(p, str) for p in policies):
            conn.policies = tuple(policies)
        kind = h.get("engine_kind")
        conn.engine_kind = kind if isinstance(kind, str) else None

    def _refresh_seen(self, conn: IngestConn, *, connected: bool) -> None:
        self._seen[conn.engine_id] = {
            "engine_id": conn.engine_id,
            "run_id": conn.run_id,
            "connected": connected,
            "model": conn.model,
            "token_budget": conn.token_budget,
            "max_token_budget": conn.max_token_budget,
            "policy": conn.policy,
            CAP_KEY: conn.long_prefill_token_threshold,
            "policies": list(conn.policies),
            "engine_kind": conn.engine_kind,
            "last_step": conn.last_step,
            "last_seen_ns": conn.last_seen_ns,
        }
        if len(self._seen) > ingest.MAX_ENGINES_REMEMBERED:
            for engine_id in ingest.seen_to_forget(self._seen):
                del self._seen[engine_id]

    async def _ingest_frame(self, conn: IngestConn, raw: str | bytes) -> bool:
        """Handle one frame after the hello (the rules are ``storage.ingest``'s; this carries
        out the verdict); False when the connection was closed."""
        if conn.failed:
            await conn.ws.close(CLOSE_STORE_ERROR, "store error; resend")
            return False
        msg, why = ingest.parse(raw)
        if msg is None:
            await self._close(conn.ws, CLOSE_BAD_INPUT, why)
            return False
        verdict = ingest.frame(
            msg, engine_id=conn.engine_id, run_id=conn.run_id, expected=conn.expected
        )
        if verdict.control_ack is not None:
            self._control_ack(conn, verdict.control_ack)
            return True
        if verdict.close is not None:
            await self._close(conn.ws, CLOSE_BAD_INPUT, verdict.close)
            return False
        if verdict.duplicates:
            self.metrics.duplicates.inc(verdict.duplicates)
        if verdict.accepted:
            await self._backpressure()
            if not conn.current or conn.failed:
                return False
            conn.expected = verdict.expected
            if verdict.accepted[-1].get("type") == "goodbye":
                conn.said_goodbye = True
            if conn.declared:
                _stamp_declared(conn.declared, verdict.accepted)
            self._note_progress(conn, verdict.accepted)
            self._submit(Events(conn.run_key, verdict.accepted, tag=conn))
        if verdict.error is not None:
            self.metrics.refuse(verdict.error["code"])
            await self._send(conn.ws, verdict.error)
        return True

    def _note_progress(self, conn: IngestConn, events: list[dict[str, Any]]) -> None:
        for ev in reversed(events):
            if ev.get("type") == "step":
                step, end_ns = ev.get("step"), ev.get("end_ns")
                if isinstance(step, int):
                    conn.last_step = step
                if isinstance(end_ns, int):
                    conn.last_seen_ns = end_ns
                if _before(step, conn.settings_from_step):
                    break
                budget, policy = ev.get("token_budget"), ev.get("policy")
                if isinstance(budget, int):
                    conn.token_budget = budget
                if isinstance(policy, str):
                    conn.policy = policy
                cap = ev.get(CAP_KEY)
                if isinstance(cap, int) and not isinstance(cap, bool):
                    conn.long_prefill_token_threshold = cap
                break
        for ev in events:
            if ev.get("type") == "control" and ev.get("accepted"):
                _note_applied(conn, ev.get("applied_at_step"))
                if ev.get("key") == "token_budget" and isinstance(ev.get("new_value"), int):
                    conn.token_budget = ev["new_value"]
                elif ev.get("key") == "policy" and isinstance(ev.get("new_value"), str):
                    conn.policy = ev["new_value"]
                elif ev.get("key") == CAP_KEY and isinstance(ev.get("new_value"), int):
                    conn.long_prefill_token_threshold = ev["new_value"]
        if self._by_engine.get(conn.engine_id) is conn:
            self._refresh_seen(conn, connected=True)

    # -- control relay ------------------------------------------------------------------------

    def _control_ack(self, conn: IngestConn, msg: dict[str, Any]) -> None:
        cid = msg.get("id")
        fut = conn.pending.pop(str(cid), None) if cid is not None else None
        if fut is None:
            logger.warning("control_ack for unknown id %r from %s", cid, conn.engine_id)
            return
        if not fut.done():
            fut.set_result(msg)

    async def _control_client(self, ws: ServerConnection) -> None:
        self.metrics.control_clients.inc()
        presented = presented_token(ws.request) if ws.request is not None else None
        # a client holding one engine's own control token sees and steers that engine only
        scope = credentials.steers_only(presented, self.config.engine_credentials)
        in_flight: set[asyncio.Task[Any]] = set()
        try:
            async for raw in ws:
                msg, why = ingest.check_control_message(raw)
                if msg is None:
                    self.metrics.refuse("control_bad_input")
                    await self._send(ws, {"type": "error", "code": "bad_input", "message": why})
                    continue
                kind = msg.get("type")
                if kind == "list_engines":
                    await self._send(ws, self.engines_reply(msg, only=scope))
                elif kind == "control":
                    if len(in_flight) >= MAX_CONTROLS_IN_FLIGHT:
                        self.metrics.refuse("control_busy")
                        await self._send(
                            ws,
                            {
                                "type": "error",
                                "code": "busy",
                                "message": f"at most {MAX_CONTROLS_IN_FLIGHT} controls in flight "
                                "per client; wait for an answer",
                            },
                        )
                        continue
                    # Several controls from one client may be in flight at once.
                    task = asyncio.ensure_future(self._relay_and_answer(ws, msg, presented))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    self.metrics.refuse("unknown_message")
                    await self._send(
                        ws,
                        {
                            "type": "error",
                            "code": "unknown_message",
                            "message": f"unknown message type {kind!r}: use list_engines or "
                            "control",
                        },
                    )
        except ConnectionClosed:
            pass
        finally:
            self.metrics.control_clients.dec()

    def list_engines(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self._seen.values()]

    def engines_reply(self, msg: dict[str, Any], only: str | None = None) -> dict[str, Any]:
        """The ``engines`` reply: connected engines first, then the others, at most
        ``ingest.MAX_ENGINES_LISTED`` from ``offset`` (``next_offset`` when more follow);
        ``only``: that engine id alone."""
        self._expire_kept_routes()
        rows = self.list_engines()
        if only is not None:
            rows = [r for r in rows if r.get("engine_id") == only]
        return ingest.engines_page(rows, msg.get("offset"))

    async def _relay_and_answer(
        self, ws: ServerConnection, msg: dict[str, Any], presented: str | None
    ) -> None:
        answer = await self.relay(msg, presented)
        await self._send(ws, answer)

    async def relay(self, msg: dict[str, Any], presented: str | None = None) -> dict[str, Any]:
        """Check a control, forward it to its engine, and return the control_ack to send back.
        ``presented``: the token the /control client connected with; a ``token`` in the
        message itself (older clients) takes its place."""
        cid = msg.get("id")
        cid = (
            ingest.clean_text(str(cid), ingest.MAX_ID_CHARS)
            if cid is not None
            else f"collector-{next(self._ids)}"
        )
        engine_id = msg.get("engine_id")
        run_id = msg.get("run_id")  # optional: which live run of the engine id
        new = msg.get("set")
        conn = None
        self._expire_kept_routes()
        if isinstance(engine_id, str):
            if isinstance(run_id, str):
                conn = self._live(engine_id, run_id)
            elif run_id is None:
                conn = self._by_engine.get(engine_id)
        param: str | None = None

        def refuse(reason: str, outcome: str) -> dict[str, Any]:
            self.metrics.controls.labels(outcome=outcome).inc()
            self.metrics.refuse(f"control_{outcome}")
            # One row at most per refused message, and none for an engine never seen: checked
            # before anything is stored, so no message can make the writer work per key.
            row = ingest.control_refusal_row(
                msg,
                param,
                known_engine=isinstance(engine_id, str) and engine_id in self._seen,
            )
            if row is not None and isinstance(engine_id, str):
                key, value = row
                run = conn.run_id if conn is not None else self._seen[engine_id].get("run_id")
                self._submit(
                    CollectorControl(
                        engine_id=engine_id,
                        run_id=run,
                        key=key,
                        old_value=getattr(conn, key, None) if conn is not None and key else None,
                        new_value=value,
                        reason=ingest.clean_text(reason, 500),
                        request_id=cid,
                    )
                )
            logger.info("control %s for %r refused: %s", cid, str(engine_id)[:128], reason[:500])
            return {"type": "control_ack", "id": cid, "ok": False, "error": reason}

        token = msg.get("token")
        if token is None:
            token = presented
        why = credentials.may_steer(
            engine_id if isinstance(engine_id, str) else "",
            token,
            shared=self.config.control_token,
            engines=self.config.engine_credentials,
        )
        if why:
            return refuse(why, "token")
        if not isinstance(engine_id, str) or not engine_id:
            return refuse("engine_id must be a non-empty string", "bad_request")
        if run_id is not None and not isinstance(run_id, str):
            return refuse("run_id must be a string when given", "bad_request")
        if conn is None:
            if engine_id in self._seen:
                which = f"run {run_id} of engine {engine_id}" if run_id else f"engine {engine_id}"
                return refuse(f"{which} is not connected", "disconnected")
            return refuse(f"unknown engine {engine_id[:128]!r}", "unknown_engine")
        try:
            check_changes(new, conn.max_token_budget, conn.policies)
        except ControlRefused as exc:
            param = exc.param
            code = "bad_request" if exc.param is None else "bad_value"
            if exc.param is not None and exc.param not in CONTROL_KEYS:
                code = "bad_key"
            return refuse(exc.reason[:500], code)
        assert isinstance(new, dict)
        try:
            source, why = relay_declaration(msg)
        except ControlRefused as exc:
            param = exc.param
            return refuse(exc.reason, "bad_request")
        if cid in conn.pending:
            return refuse(f"a control with id {cid!r} is already pending", "bad_request")
        assert self._loop is not None
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        conn.pending[cid] = fut
        if source != "collector" or why is not None:
            conn.declared[cid] = (source, why)
            conn.declared.move_to_end(cid)
            while len(conn.declared) > MAX_DECLARED:
                conn.declared.popitem(last=False)
        out: dict[str, Any] = {"type": "control", "id": cid, "set": new}
        if isinstance(token, str):
            # Never the token itself: a MAC under it, bound to this engine, run and control id.
            out["mac"] = control_mac(
                token, control_id=cid, engine_id=conn.engine_id, run_id=conn.run_id, changes=new
            )
        try:
            await conn.ws.send(json.dumps(out, allow_nan=False))
            answer = await asyncio.wait_for(fut, self.config.control_timeout)
        except ConnectionClosed:
            return refuse(f"engine {engine_id} disconnected before answering", "disconnected")
        except TimeoutError:
            return refuse(
                f"no answer from engine {engine_id} within {self.config.control_timeout:g} s",
                "timeout",
            )
        finally:
            conn.pending.pop(cid, None)
        if "type" not in answer:
            # The engine dropped before answering (see _disconnected): the collector refuses.
            return refuse(str(answer.get("error")), "disconnected")
        ok = bool(answer.get("ok"))
        self.metrics.controls.labels(outcome="accepted" if ok else "refused_by_engine").inc()
        if ok:
            for key, value in new.items():
                setattr(conn, key, value)
            _note_applied(conn, answer.get("applied_at_step"))
            self._refresh_seen(conn, connected=True)
        return {**answer, "type": "control_ack", "id": cid}
