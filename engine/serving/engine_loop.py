"""Step loops: route engine outputs to per-request asyncio queues.

HTTP handlers only queue requests into the engine and read their outputs from per-request
asyncio queues that another thread fills with ``loop.call_soon_threadsafe``. So HTTP handling
never blocks a step, and a step never waits on a client. ``EngineLoop`` runs ``engine.step()``
on a thread of the server process; ``engine_proc.ProcessLoop`` reads the outputs of an engine
core running in its own process. Both share ``StreamRouter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.protocol import APIError

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine failed while serving this request."""


@dataclass
class _Stream:
    queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


class StreamRouter:
    """Submit requests, route their outputs to per-request queues, fail them on errors.

    Subclasses run the steps (or receive them) and implement ``alive``, ``start`` and ``stop``.
    """

    mode: ClassVar[str]  # where the engine steps: "thread" (this process) or "process"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.last_error: str | None = None
        self.num_step_errors = 0

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    # request side (event loop thread) ------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: Any,
        *,
        traffic_class: str | None,
        images: list[Any] | None,
    ) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request in the engine; raises ValueError / QueueFullError untouched."""
        if not self.alive:
            raise APIError(
                503,
                "the engine step loop is not running; see /health and the server log",
                type="server_error",
                code="engine_dead",
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = _Stream(queue=asyncio.Queue(), loop=asyncio.get_running_loop())
        with self._lock:
            self._streams[rid] = stream
        try:
            self.engine.add_request(
                prompt_token_ids,
                params,
                request_id=rid,
                traffic_class=traffic_class,
                images=images or None,
                arrival_time=time.time(),
            )
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
            raise
        return rid, stream.queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    # step side (any thread) ----------------------------------------------------------------
    def _dispatch(self, outputs: list[Any]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = (
                    self._streams.pop(out.request_id, None)
                    if out.finished
                    else self._streams.get(out.request_id)
                )
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # loop closed: server shutting down
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, message: str) -> None:
        """Fail every request in flight with ``message`` (shutdown, a dead engine)."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _deliver(stream, RequestFailed(message))

    def _on_step_error(self, error: str, request_id: str | None) -> bool:
        """Fail the request a step failed on, or all in flight if the error names none, and
        abort them in the engine. True if there were any."""
        self.num_step_errors += 1
        self.last_error = error
        with self._lock:
            if request_id is not None and request_id in self._streams:
                victims = {request_id: self._streams.pop(request_id)}
            else:  # not attributable: fail everything in flight so the engine can recover
                victims, self._streams = self._streams, {}
        for victim_id, stream in victims.items():
            _deliver(stream, RequestFailed(f"engine step failed: {error}"))
            with contextlib.suppress(Exception):
                self.engine.abort_request(victim_id)
        return bool(victims)


class EngineLoop(StreamRouter):
    """Runs ``engine.step()`` on its own thread of the server process."""

    mode = "thread"

    def __init__(self, engine: Any, *, idle_wait: float = 0.05) -> None:
        super().__init__(engine)
        self.idle_wait = idle_wait
        self._running = False
        self._thread: threading.Thread | None = None
        self._abort_pending = threading.Event()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.alive:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="chunkscope-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("server shutting down; request stopped")

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self._abort_pending.set()

    def _run(self) -> None:
        engine = self.engine
        logger.info("step loop started")
        while self._running:
            try:
                if not engine.has_unfinished_requests() and not self._abort_pending.is_set():
                    engine.wait_for_work(self.idle_wait)
                    continue
                self._abort_pending.clear()
                result = engine.step()
            except Exception as exc:  # the loop never dies: fail what was in flight, go on
                logger.error("engine step failed:\n%s", traceback.format_exc())
                if not self._on_step_error(describe_error(exc), getattr(exc, "request_id", None)):
                    time.sleep(self.idle_wait)  # avoid a hot error loop
                continue
            if result.outputs:
                self._dispatch(result.outputs)
        logger.info("step loop stopped")


def describe_error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _deliver(stream: _Stream, item: Any) -> None:
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
