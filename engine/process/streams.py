"""Per-request output queues: register a request's stream, route outputs to it, fail it.

HTTP handlers read a request's outputs from an asyncio queue that the engine client's reader
thread fills with ``loop.call_soon_threadsafe``, so a handler never blocks a step and a step
never waits on a client. Registration and failure share one lock and a ``closed`` flag: once
the engine is gone every registered stream has been failed, and a later ``open`` is refused
with ``engine_dead``, so no request can slip in between and wait forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from engine.process.errors import APIError

logger = logging.getLogger(__name__)


class RequestFailed(RuntimeError):
    """The engine failed while serving this request (after it was admitted)."""


class RequestRefused(RuntimeError):
    """The engine core refused the request when it took it: ``kind`` is ``queue_full`` or
    ``invalid`` (the same checks the server ran, on fresher state)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Admitted:
    """The first item of every admitted request's queue: the engine core queued it."""


ADMITTED = Admitted()


class Observed:
    """The item after a request's last output: the step that finished it has been seen by the
    engine client's listeners (metrics, telemetry), so a response that ends after it has its
    events counted and queued for the collector."""


OBSERVED = Observed()


def engine_dead(reason: str) -> APIError:
    return APIError(503, reason, type="server_error", code="engine_dead")


@dataclass
class _Stream:
    queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


class StreamRouter:
    """The table of requests in flight and their queues (thread-safe)."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._closed: str | None = None  # why, once closed

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def open(self, request_id: str) -> asyncio.Queue[Any]:
        """Register a stream for ``request_id`` (on the caller's event loop), or raise the
        ``engine_dead`` 503 if the router is closed."""
        stream = _Stream(queue=asyncio.Queue(), loop=asyncio.get_running_loop())
        with self._lock:
            if self._closed is not None:
                raise engine_dead(self._closed)
            self._streams[request_id] = stream
        return stream.queue

    def drop(self, request_id: str) -> None:
        """Forget a stream (its request was aborted); later outputs for it are discarded."""
        with self._lock:
            self._streams.pop(request_id, None)

    def close(self, reason: str) -> None:
        """Fail every stream with ``reason`` and refuse new ones (shutdown, a dead core)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _deliver(stream, RequestFailed(reason))

    def admit(self, request_id: str, refusal: RequestRefused | None) -> None:
        """The core's answer to an add: ``ADMITTED`` first in the queue, or the refusal (which
        ends the stream)."""
        with self._lock:
            if refusal is None:
                stream = self._streams.get(request_id)
            else:
                stream = self._streams.pop(request_id, None)
        if stream is not None:
            _deliver(stream, ADMITTED if refusal is None else refusal)

    def fail(self, request_id: str | None, message: str) -> list[str]:
        """Fail the stream of ``request_id``, or every stream if it is None or not in flight
        (an error nobody can be blamed for); the ids failed."""
        with self._lock:
            if request_id is not None and request_id in self._streams:
                victims = {request_id: self._streams.pop(request_id)}
            else:
                victims, self._streams = self._streams, {}
        for stream in victims.values():
            _deliver(stream, RequestFailed(message))
        return list(victims)

    def dispatch(self, outputs: list[Any], wait_s: float = 0.0) -> bool:
        """Route one step's outputs. A finished request's stream stays registered until
        :meth:`observed` ends it.

        With ``wait_s``, return once every event loop that got outputs has run the handlers they
        woke (the tokens are written to their sockets), or after ``wait_s``: the caller holds
        the GIL back from the loops until then. False when it gave up waiting."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        done: list[threading.Event] = []
        for loop, items in by_loop.items():
            flushed = threading.Event() if wait_s > 0 else None
            try:
                loop.call_soon_threadsafe(_put_all, loop, items, flushed)
            except RuntimeError:  # loop closed: server shutting down
                continue
            if flushed is not None:
                done.append(flushed)
        deadline = time.monotonic() + wait_s
        return all(ev.wait(max(0.0, deadline - time.monotonic())) for ev in done)

    def observed(self, request_ids: list[str]) -> None:
        """The listeners have seen the step that finished these requests: ``OBSERVED`` ends
        each one's stream, which is removed."""
        with self._lock:
            streams = [s for rid in request_ids if (s := self._streams.pop(rid, None))]
        for stream in streams:
            _deliver(stream, OBSERVED)


def _deliver(stream: _Stream, item: Any) -> None:
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _put_all(
    loop: asyncio.AbstractEventLoop,
    items: list[tuple[asyncio.Queue[Any], Any]],
    flushed: threading.Event | None,
) -> None:
    for queue, item in items:
        queue.put_nowait(item)
    if flushed is not None:
        # Each put scheduled its consumer's wake-up for the loop's next turn (a handler awaits
        # its queue directly, writes its chunk and awaits the next in that one turn); the
        # event is set one turn later still, after every consumer woken in that turn.
        loop.call_soon(loop.call_soon, flushed.set)
