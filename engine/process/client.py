"""The server's handle on the engine core: one client for every transport.

``EngineClient`` checks requests with the limits the core reported at start-up
(``engine.core.admission``, the very checks the engine runs), sends commands through a writer thread
(so the event loop never blocks on a full pipe), and a reader thread blocks on the results
channel and, per batch, in order: feeds the events to the listeners (metrics, telemetry; one
thread, event order), routes admissions and outputs to the per-request queues
(``streams.StreamRouter``) and resolves control calls. The core re-checks every request on
fresher state; its refusals come back with their kind (``queue_full``, ``invalid``), so a
client gets the same 503 / 400 whichever side refused.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.core.admission import check_queue, check_request
from engine.core.config import EngineConfig
from engine.core.outputs import EngineStats
from engine.process.core import CoreBatch, CoreInfo
from engine.process.streams import RequestRefused, StreamRouter, engine_dead
from engine.process.transport import ProcessTransport, ThreadTransport
from engine.tokenizer import make_tokenizer
from wire.control import ControlRefused
from wire.events import ControlEvent, Event

logger = logging.getLogger(__name__)
# How long the reader waits for the handlers to write a step's tokens before it runs the step's
# listeners anyway (a loop busy elsewhere must not hold telemetry back for long).
FLUSH_WAIT_S = 0.02


class EngineStartError(RuntimeError):
    """The engine core could not start (the message says why)."""


class EngineClient:
    """Stands in for ``LLMEngine`` in the server; the engine core runs behind ``transport``."""

    def __init__(
        self, transport: ProcessTransport | ThreadTransport, *, startup_timeout: float = 600.0
    ) -> None:
        self.transport = transport
        self.config: EngineConfig = transport.config
        info = self._wait_ready(startup_timeout)
        self.pid = info.pid
        self.engine_id = info.engine_id
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_token_budget = info.max_token_budget
        self.limits = info.limits
        self.clock_anchor = info.clock_anchor  # the core's: maps its event times to wall time
        self.cpu_threads = info.cpu_threads  # torch threads the core steps with
        self.tokenizer = transport.tokenizer or make_tokenizer(
            info.tokenizer_folder, info.limits.vocab_size, info.eos_token_id
        )
        self.streams = StreamRouter()
        self._stats = info.stats
        self._token_budget = info.stats.token_budget
        self._policy = info.stats.policy
        self._cap = info.stats.long_prefill_token_threshold
        self._lock = threading.Lock()
        self._pending_adds = 0  # sent, not yet counted in a step batch's stats
        self._calls: dict[int, Future[Any]] = {}
        self._calls_closed: str | None = None
        self._call_ids = itertools.count()
        self._listeners: list[Callable[[Event], None]] = []
        self._closing = False
        self.exit_reason: str | None = None
        self.last_error: str | None = None
        self.num_step_errors = 0
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="chunkscope-core-tx", daemon=True)
        self._reader = threading.Thread(target=self._read, name="chunkscope-core-rx", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self.shutdown)  # before multiprocessing's own exit hook kills the child
        logger.info(
            "engine core running (%s, pid %d, %s, %s torch threads)",
            self.mode,
            self.pid,
            self.engine_id,
            self.cpu_threads,
        )

    @classmethod
    def spawn(cls, config: EngineConfig, **kw: Any) -> EngineClient:
        """The engine core in a child process (the server's default)."""
        return cls(ProcessTransport(config), **kw)

    @classmethod
    def in_thread(cls, engine: Any, **kw: Any) -> EngineClient:
        """The engine core on a thread of this process; ``engine``: LLMEngine or EngineConfig."""
        return cls(ThreadTransport(engine), **kw)

    def _wait_ready(self, timeout: float) -> CoreInfo:
        results, transport = self.transport.results, self.transport
        deadline = time.monotonic() + timeout
        while not results.poll(0.1):
            if not transport.is_alive():
                raise EngineStartError(
                    f"{transport.describe_exit()} before it was ready; see the log"
                )
            if time.monotonic() > deadline:
                transport.kill()
                raise EngineStartError(f"the engine core was not ready within {timeout:.0f} s")
        try:
            kind, payload = results.recv()
        except (EOFError, OSError) as exc:
            transport.kill()
            raise EngineStartError(f"the engine core died while starting: {exc}") from exc
        if kind != "ready":
            transport.stop(5)
            raise EngineStartError(str(payload))
        assert isinstance(payload, CoreInfo)
        return payload

    # --- what the server reads ----------------------------------------------------------------
    @property
    def mode(self) -> str:
        """Where the core runs: ``process`` or ``thread``."""
        return self.transport.kind

    @property
    def engine(self) -> Any:
        """The ``LLMEngine`` itself with the thread transport; None with the process one."""
        return self.transport.engine

    @property
    def alive(self) -> bool:
        """The core runs and its results channel is open (a crash closes it at once)."""
        return not self.streams.closed and not self._closing

    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def long_prefill_token_threshold(self) -> int:
        return self._cap

    def stats(self) -> EngineStats:
        """The latest batch's snapshot (counts as of the last step)."""
        return self._stats

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn`` with every engine event, on the reader thread, in event order."""
        self._listeners.append(fn)

    # --- requests (any thread with a running event loop) ---------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: Any,
        *,
        traffic_class: str | None = None,
        images: list[Any] | None = None,
    ) -> tuple[str, asyncio.Queue[Any]]:
        """Check a request here and send it; its queue gets ``ADMITTED`` or a
        ``RequestRefused`` first, then its outputs. Raises ValueError / TypeError /
        QueueFullError when the local checks refuse it, the engine_dead 503 once the core is
        gone."""
        prompt = check_request(prompt_token_ids, params, images, self.limits)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        with self._lock:
            check_queue(self._stats.num_waiting + self._pending_adds, self.limits)
            stream = self.streams.open(request_id)  # engine_dead once closed
            self._pending_adds += 1
        arrival_ns = time.monotonic_ns()
        self._outbox.put(
            ("add", request_id, prompt, params, traffic_class, images or None, arrival_ns)
        )
        return request_id, stream

    def abort(self, request_id: str, reason: str | None = None) -> None:
        """Stop a request: its stream is dropped here and the core aborts it (``reason``:
        why, e.g. ``stop`` when a stop string ended it; None: an abort)."""
        self.streams.drop(request_id)
        self._outbox.put(("abort", request_id, reason))

    def abort_request(self, request_id: str, reason: str | None = None) -> None:
        """``LLMEngine``'s name for ``abort``."""
        self.abort(request_id, reason)

    async def control(
        self, changes: dict[str, object], *, source: str, request_id: str | None = None
    ) -> list[ControlEvent]:
        """Apply checked scheduler changes in the core (all at the same step); the engine's
        ``ControlEvent`` per key. Awaited without blocking the loop and without a timeout that
        could misreport an applied change: it ends when the core answers or dies."""
        future: Future[Any] = Future()
        with self._lock:
            if self._calls_closed is not None or self._closing:
                raise engine_dead(self._calls_closed or "the engine core is stopped")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._outbox.put(("control", call_id, dict(changes), source, request_id))
        reply = await asyncio.wrap_future(future)
        if reply.refused is not None:
            raise ControlRefused(reply.refused, reply.param)
        return list(reply.events)

    # --- shutdown -----------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to stop; stop it harder if it does not within ``timeout``. Requests in
        flight fail with 'server shutting down'."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        self.transport.stop(timeout)
        self._writer.join(2)
        self._reader.join(2)
        reason = "the server is shutting down; request stopped"
        self.streams.close(reason)
        self._fail_calls(reason)
        logger.info("engine core (%s, pid %d) stopped", self.mode, self.pid)

    # --- threads ------------------------------------------------------------------------------
    def _write(self) -> None:
        commands = self.transport.commands
        while (cmd := self._outbox.get()) is not None:
            try:
                commands.send(cmd)
            except OSError:  # the core is gone; the reader reports it
                return
        commands.close()

    def _read(self) -> None:
        failure: str | None = None
        results = self.transport.results
        while failure is None:
            try:
                batch = results.recv()
            except (EOFError, OSError):  # the core exited (or was killed)
                break
            try:
                self._apply(batch)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
                logger.exception("handling a batch from the engine core failed")
                failure = f"the engine client failed: {exc}"
        if self._closing:
            return
        if failure is None:
            failure = self.transport.describe_exit()
        else:
            self.transport.kill()
        self.exit_reason = self.last_error = failure
        logger.error("%s; failing the requests in flight", failure)
        self.streams.close(failure)
        self._fail_calls(failure)

    def _apply(self, batch: CoreBatch) -> None:
        with self._lock:
            self._pending_adds -= batch.num_added
            self._pending_adds -= sum(1 for a in batch.admissions if a.refusal is not None)
            self._stats = batch.stats
        self._token_budget, self._policy = batch.token_budget, batch.policy
        self._cap = batch.long_prefill_token_threshold
        for adm in batch.admissions:
            refusal = (
                None if adm.refusal is None else RequestRefused(adm.refusal, adm.message or "")
            )
            self.streams.admit(adm.request_id, refusal)
        # Tokens go to their streams before the listeners (telemetry, metrics) see the step's
        # events, and the listeners wait until the handlers have written them (run at once,
        # they would hold the GIL while the event loop waits for it to send the tokens), so a
        # client gets each token, its last one too, as soon as its step's batch is read. A
        # finished request's stream ends (OBSERVED) once they have run, so once a response
        # has ended its events have been seen.
        if batch.outputs:
            self.streams.dispatch(batch.outputs, wait_s=FLUSH_WAIT_S)
        for event in batch.events:
            for fn in self._listeners:
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 - an observer never stops the engine
                    logger.exception("event listener %r failed", fn)
        for reply in batch.replies:
            self._resolve_call(reply.call_id, reply)
        finished = [out.request_id for out in batch.outputs if out.finished]
        if finished:
            self.streams.observed(finished)
        if batch.error is not None:
            self._on_step_error(batch.error, batch.error_request_id)

    def _resolve_call(self, call_id: int, reply: Any) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is not None:
            future.set_result(reply)

    def _on_step_error(self, error: str, request_id: str | None) -> None:
        """Fail the request a step failed on, or all in flight if the error names none, and
        abort them in the core so it can go on."""
        self.num_step_errors += 1
        self.last_error = error
        for victim in self.streams.fail(request_id, f"engine step failed: {error}"):
            self._outbox.put(("abort", victim, None))

    def _fail_calls(self, reason: str) -> None:
        with self._lock:
            self._calls_closed = self._calls_closed or reason
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(engine_dead(reason))
