"""The collector's shared state and its plumbing to the writer: the record of one engine
connection, the queue of store operations, the commit callback that counts and acknowledges
what was stored, and the helpers every handler sends and spawns with."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.server import Server, ServerConnection
from websockets.exceptions import ConnectionClosed

from storage import ingest
from storage.collector_config import CLOSE_STORE_ERROR, CollectorConfig
from storage.collector_metrics import Metrics
from storage.store import Events, EventsResult, SeqHole
from storage.writer import Writer
from wire.control import CAP_KEY, POLICIES

logger = logging.getLogger("storage.collector")


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
    metrics_url: str | None = None  # the hello's metrics_url: the engine's Prometheus /metrics
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


def note_applied(conn: IngestConn, step: Any) -> None:
    """An accepted control is in force from ``step`` (its ``applied_at_step``)."""
    if isinstance(step, int) and not isinstance(step, bool):
        conn.settings_from_step = max(step, conn.settings_from_step or step)


@dataclass(eq=False)
class Slot:
    """One admitted /ingest or /control connection, as the connection limits count it."""

    kind: str  # "control", "ingest" (with a credential) or "unidentified"
    peer: str


class CollectorCore:
    """The state the collector's handlers share, and the plumbing to the writer."""

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
        # bytes of the frames whose events wait for the writer (id(op) -> that frame's size)
        self._pending_bytes = 0
        self._op_bytes: dict[int, int] = {}
        self._drained = asyncio.Event()
        self._ids = itertools.count(1)
        # (engine_id, run_id) -> hellos submitted to the writer and not answered yet, and the
        # run key whose Disconnect waits for them (see _disconnected)
        self._hellos_pending: dict[tuple[str, str], int] = {}
        self._deferred_disconnect: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        # admitted /ingest and /control connections (see _admit), and their counts
        self._slots: dict[ServerConnection, Slot] = {}
        self._n_conns = 0
        self._n_control = 0
        self._n_unidentified = 0
        self._unidentified_by_peer: dict[str, int] = {}
        self._retention: threading.Thread | None = None
        self._retention_stop = threading.Event()

    # -- writer plumbing ----------------------------------------------------------------------

    def _submit(
        self, op: Any, *, want_result: bool = False, nbytes: int = 0
    ) -> asyncio.Future[Any] | None:
        """Queue ``op`` for the writer; ``nbytes``: the size of the frame an ``Events`` op came
        in (counted against ``max_pending_bytes`` until its commit)."""
        assert self._writer is not None and self._loop is not None
        fut = None
        if want_result:
            fut = self._loop.create_future()
            self._futures[id(op)] = fut
        if isinstance(op, Events):
            self._pending_events += len(op.events)
            self.metrics.pending.set(self._pending_events)
            if nbytes:
                self._op_bytes[id(op)] = nbytes
                self._pending_bytes += nbytes
                self.metrics.pending_bytes.set(self._pending_bytes)
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
            self._pending_bytes -= self._op_bytes.pop(id(op), 0)
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
        m.pending_bytes.set(self._pending_bytes)
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

    def _no_room(self, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` would take what waits for the writer past
        ``max_pending_bytes`` (a frame always fits when nothing waits)."""
        pending = self._pending_bytes
        return pending > 0 and pending + nbytes > self.config.max_pending_bytes

    async def _backpressure(self) -> None:
        while self._pending_events > self.config.max_pending_events:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), 1.0)
            except TimeoutError:
                pass

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
            "metrics_url": conn.metrics_url,
            "last_step": conn.last_step,
            "last_seen_ns": conn.last_seen_ns,
        }
        if len(self._seen) > ingest.MAX_ENGINES_REMEMBERED:
            for engine_id in ingest.seen_to_forget(self._seen):
                del self._seen[engine_id]
