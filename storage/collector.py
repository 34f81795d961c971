"""The collector: engines stream events to ``/ingest``, control clients use ``/control``.

One asyncio event loop serves every connection; handlers parse and check frames and only
enqueue them (``storage.writer``); the writer thread commits in batches and the acks go out
after the commit. ``GET /healthz`` and ``GET /metrics`` answer on the same port
(``process_request``). The wire contract is docs/telemetry.md.

This module wires the server and runs it; the jobs live beside it: ``collector_config`` (the
settings and limits), ``collector_core`` (shared state, the writer plumbing),
``collector_admission`` (handshake tokens, connection limits), ``collector_ingest`` (/ingest),
``collector_relay`` (/control and the control routes) and ``collector_metrics`` (health and
Prometheus metrics). Their public names are importable from here too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from storage import db as dbm
from storage import retention
from storage.collector_admission import Admission
from storage.collector_config import (
    CLOSE_AUTH,
    CLOSE_BUSY,
    CLOSE_NOT_YOURS,
    CLOSE_REPLACED,
    CLOSE_STORE_ERROR,
    CLOSE_TOO_BIG,
    CLOSE_TOO_MANY_RUNS,
    DEFAULT_HELLO_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_PENDING_BYTES,
    DEFAULT_MAX_PENDING_EVENTS,
    DEFAULT_MAX_UNIDENTIFIED,
    DEFAULT_MAX_UNIDENTIFIED_PER_PEER,
    DEFAULT_PORT,
    DEFAULT_ROUTE_GRACE,
    MAX_CONTROLS_IN_FLIGHT,
    MAX_QUEUED_FRAMES,
    RESERVED_CONNECTIONS,
    CollectorConfig,
    bearer,
    presented_token,
)
from storage.collector_core import IngestConn
from storage.collector_ingest import IngestHandling
from storage.collector_metrics import Metrics, health_response, metrics_response
from storage.collector_relay import MAX_DECLARED, ControlRelay
from storage.writer import Writer

__all__ = [
    "CLOSE_AUTH",
    "CLOSE_BUSY",
    "CLOSE_NOT_YOURS",
    "CLOSE_REPLACED",
    "CLOSE_STORE_ERROR",
    "CLOSE_TOO_BIG",
    "CLOSE_TOO_MANY_RUNS",
    "DEFAULT_HELLO_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_PENDING_BYTES",
    "DEFAULT_MAX_PENDING_EVENTS",
    "DEFAULT_MAX_UNIDENTIFIED",
    "DEFAULT_MAX_UNIDENTIFIED_PER_PEER",
    "DEFAULT_PORT",
    "DEFAULT_ROUTE_GRACE",
    "MAX_CONTROLS_IN_FLIGHT",
    "MAX_DECLARED",
    "MAX_QUEUED_FRAMES",
    "RESERVED_CONNECTIONS",
    "Collector",
    "CollectorConfig",
    "IngestConn",
    "Metrics",
    "bearer",
    "presented_token",
]

logger = logging.getLogger(__name__)


class Collector(IngestHandling, ControlRelay, Admission):
    """The collector's server: its life cycle, the HTTP answers, and the handler of each
    connection (the handlers' jobs are the base classes')."""

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
            max_runs_per_engine=self.config.max_runs_per_engine,
            runs_window=self.config.runs_window,
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
        await self._fleet_start()
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
        await self._fleet_stop()
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
        """Answer ``/healthz`` and ``/metrics``; check and admit ``/ingest`` and ``/control``."""
        path, _, query = request.path.partition("?")
        if path == "/healthz":
            return health_response(connection, self.store_problem())
        if path == "/metrics":
            return metrics_response(connection, self.metrics.registry)
        if path in ("/sd", "/http_sd"):
            return self.sd_response(connection)
        if path not in ("/ingest", "/control"):
            return connection.respond(
                HTTPStatus.NOT_FOUND,
                "not found: use /ingest, /control, /healthz, /metrics or /sd\n",
            )
        return self._gate(connection, request, path)

    async def _handle(self, ws: ServerConnection) -> None:
        path = ws.request.path.partition("?")[0] if ws.request else ""
        try:
            if path == "/control":
                await self._control_client(ws)
            else:
                await self._ingest(ws)
        finally:
            self._release(ws)
