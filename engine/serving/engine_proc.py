"""Process mode: the engine core runs in a child process; the server process is a thin client.

The step loop and the HTTP event loop then hold separate GILs (vLLM V1's split). ``EngineClient``
starts the child (``engine_core.run_engine_core``, spawned, daemon) and stands in for
``LLMEngine`` in the server: it checks requests locally with the limits the child reported at
start-up (``engine.admission``, the very checks the engine runs), sends commands through a
writer thread (so the event loop never blocks on a full pipe), and a reader thread blocks on
the result pipe (releasing the GIL) and hands each step's batch to the event listeners and to
``ProcessLoop``, which routes outputs to the per-request queues as ``EngineLoop`` does.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from engine.admission import check_queue, check_request
from engine.config import EngineConfig
from engine.events import ControlEvent, Event
from engine.outputs import EngineStats, RequestOutput
from engine.protocol import APIError
from engine.sampling_params import SamplingParams
from engine.serving.engine_core import CoreBatch, CoreInfo, run_engine_core
from engine.serving.engine_loop import StreamRouter
from engine.tokenizer import make_tokenizer

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT_S = 10.0


class EngineStartError(RuntimeError):
    """The engine core process could not start (the message says why)."""


class EngineClient:
    """The server process's stand-in for ``LLMEngine``; the engine runs in a child process."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        startup_timeout: float = 600.0,
        log_level: int | None = None,
    ) -> None:
        self.config = config.validate()
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._commands = ctx.Pipe(duplex=False)
        self._results, res_send = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(config, cmd_recv, res_send, level),
            name="chunkscope-engine-core",
            daemon=True,
        )
        self._proc.start()
        cmd_recv.close()  # the child holds the only copies: its exit is EOF here
        res_send.close()
        info = self._wait_ready(startup_timeout)
        self.pid = info.pid
        self.engine_id = info.engine_id
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_token_budget = info.max_token_budget
        self.limits = info.limits
        self.tokenizer = make_tokenizer(
            info.tokenizer_folder, info.limits.vocab_size, info.eos_token_id
        )
        self._stats = info.stats
        self._token_budget = info.stats.token_budget
        self._policy = info.stats.policy
        self._lock = threading.Lock()
        self._pending_adds = 0  # sent, not yet counted in a batch's stats
        self._calls: dict[int, Future[ControlEvent]] = {}
        self._call_ids = itertools.count()
        self._listeners: list[Callable[[Event], None]] = []
        self._on_outputs: Callable[[list[RequestOutput]], None] = lambda outputs: None
        self._on_step_error: Callable[[str, str | None], object] = lambda error, rid: None
        self._on_exit: Callable[[str], None] = lambda reason: None
        self._open = True  # the results pipe: closed when the child exits
        self._closing = False
        self.exit_reason: str | None = None
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="chunkscope-core-tx", daemon=True)
        self._reader = threading.Thread(target=self._read, name="chunkscope-core-rx", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self.shutdown)  # before multiprocessing's own exit hook kills the child
        logger.info("engine core running in process %d (%s)", self.pid, self.engine_id)

    def _wait_ready(self, timeout: float) -> CoreInfo:
        deadline = time.monotonic() + timeout
        while not self._results.poll(0.1):
            if not self._proc.is_alive():
                raise EngineStartError(
                    f"the engine core process exited with code {self._proc.exitcode} before "
                    "it was ready; see the log"
                )
            if time.monotonic() > deadline:
                self._kill()
                raise EngineStartError(f"the engine core was not ready within {timeout:.0f} s")
        try:
            kind, payload = self._results.recv()
        except (EOFError, OSError) as exc:
            self._kill()
            raise EngineStartError(f"the engine core process died while starting: {exc}") from exc
        if kind != "ready":
            self._proc.join(5)
            self._kill()
            raise EngineStartError(str(payload))
        assert isinstance(payload, CoreInfo)
        return payload

    # --- what the server uses of LLMEngine -----------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def alive(self) -> bool:
        """The child runs and its results pipe is open (a crash closes it at once)."""
        return self._open and not self._closing

    def stats(self) -> EngineStats:
        return self._stats

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        self._listeners.append(fn)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        traffic_class: str | None = None,
        images: list[Any] | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Check the request here (ValueError, TypeError, QueueFullError) and send it."""
        prompt = check_request(prompt_token_ids, params, images, self.limits)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        arrival = time.time() if arrival_time is None else arrival_time
        with self._lock:
            check_queue(self._stats.num_waiting + self._pending_adds, self.limits)
            self._pending_adds += 1
            self._outbox.put(("add", request_id, prompt, params, traffic_class, images, arrival))
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._outbox.put(("abort", request_id))

    def set_token_budget(self, value: object, source: str = "api") -> ControlEvent:
        return self._control("token_budget", value, source)

    def set_policy(self, value: object, source: str = "api") -> ControlEvent:
        return self._control("policy", value, source)

    def _control(self, key: str, value: object, source: str) -> ControlEvent:
        """A round trip: the engine's own ControlEvent, ``applied_at_step`` included."""
        if not self.alive:
            raise _dead(self.exit_reason or "the engine core process is stopped")
        future: Future[ControlEvent] = Future()
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._outbox.put(("control", call_id, key, value, source))
        try:
            return future.result(CONTROL_TIMEOUT_S)
        except FutureTimeout as exc:
            with self._lock:
                self._calls.pop(call_id, None)
            raise _dead(f"the engine core did not answer within {CONTROL_TIMEOUT_S:.0f} s") from exc

    # --- wiring to the step-output router ------------------------------------------------------
    def attach(
        self,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_step_error: Callable[[str, str | None], object],
        on_exit: Callable[[str], None],
    ) -> None:
        self._on_outputs, self._on_step_error, self._on_exit = on_outputs, on_step_error, on_exit

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the child to stop; terminate, then kill it if it does not within ``timeout``."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        self._outbox.put(("shutdown",))
        self._outbox.put(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine core did not stop within %.1f s; terminating it", timeout)
            self._kill()
        self._writer.join(2)
        self._reader.join(2)
        self._fail_calls("the server is shutting down")
        logger.info("engine core process %d stopped (exit code %s)", self.pid, self._proc.exitcode)

    def _kill(self) -> None:
        self._proc.terminate()
        self._proc.join(2)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2)

    # --- threads -------------------------------------------------------------------------------
    def _write(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._commands.send(cmd)
            except OSError:  # the child is gone; the reader reports it
                return

    def _read(self) -> None:
        failure: str | None = None
        while failure is None:
            try:
                batch = self._results.recv()
            except (EOFError, OSError):  # the child exited (or was killed)
                break
            try:
                self._apply(batch)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave requests hanging
                logger.exception("handling a batch from the engine core failed")
                failure = f"the engine client failed: {exc}"
        self._open = False
        if self._closing:
            return
        if failure is None:
            self._proc.join(2)
            code = self._proc.exitcode
            how = (
                f"killed by {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exit code {code}"
            )
            failure = f"the engine core process (pid {self.pid}) died: {how}"
        else:
            self._kill()
        self.exit_reason = failure
        logger.error("%s; failing the requests in flight", failure)
        self._fail_calls(failure)
        self._on_exit(failure)

    def _apply(self, batch: CoreBatch) -> None:
        with self._lock:
            self._pending_adds -= batch.num_added
            self._stats = batch.stats
        self._token_budget, self._policy = batch.token_budget, batch.policy
        for event in batch.events:
            for fn in self._listeners:
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 - an observer never stops the engine
                    logger.exception("event listener %r failed", fn)
        for call_id, reply in batch.replies:
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None:
                future.set_result(reply)
        if batch.outputs:
            self._on_outputs(batch.outputs)
        if batch.error is not None:
            self._on_step_error(batch.error, batch.error_request_id)

    def _fail_calls(self, reason: str) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(_dead(reason))


class ProcessLoop(StreamRouter):
    """The step loop of process mode: outputs arrive from the engine core's batches."""

    mode = "process"

    def __init__(self, client: EngineClient) -> None:
        super().__init__(client)
        self.client = client
        client.attach(self._dispatch, self._on_step_error, self._core_exited)

    @property
    def alive(self) -> bool:
        return self.client.alive

    def start(self) -> None:
        """The core runs from the client's construction; nothing to start."""

    def stop(self, timeout: float = 10.0) -> None:
        self.client.shutdown(timeout=min(timeout, 5.0))
        self._fail_all("server shutting down; request stopped")

    def _core_exited(self, reason: str) -> None:
        self.last_error = reason
        self._fail_all(reason)


def _dead(reason: str) -> APIError:
    return APIError(503, reason, type="server_error", code="engine_dead")
