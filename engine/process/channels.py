"""In-process channels with the ``multiprocessing.connection.Connection`` API the core and the
client use: ``QueueChannel`` (two threads of one process) and ``read_ahead`` (a pipe's receiving
end read by a thread of its own, so that what was sent arrives while the reader is busy).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_EOF = object()


class _Receiver(Protocol):
    def recv(self) -> Any: ...


class QueueChannel:
    """A one-way in-process channel with the ``Connection`` API the core and client use.

    Either end may ``close`` it: the receiver then gets EOFError once the messages already sent
    are read, and a sender gets OSError.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._next: Any = None
        self._has_next = False
        self._closed = False

    def send(self, obj: Any) -> None:
        if self._closed:
            raise OSError("channel is closed")
        self._queue.put(obj)

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._has_next:
            return True
        try:
            if timeout == 0:
                self._next = self._queue.get_nowait()
            else:
                self._next = self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        self._has_next = True
        return True

    def recv(self) -> Any:
        if not self._has_next:
            self.poll(None)
        item = self._next
        if item is _EOF:
            raise EOFError("channel closed")
        self._next, self._has_next = None, False
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_EOF)


def read_ahead(channel: _Receiver, name: str = "chunkscope-read-ahead") -> QueueChannel:
    """A ``QueueChannel`` filled from ``channel`` by a daemon thread: every message is received
    (read off the pipe and unpickled) as soon as it is sent, whatever the caller is doing; the
    caller reads them in order with ``poll``/``recv`` and gets EOFError after the last one
    once ``channel`` ends.

    Why the engine core reads its commands this way: it reads them between steps. Read straight
    from the pipe, a request sent during a long step waits in the pipe (a request with an image
    is megabytes; the sender blocks on the full pipe), and at the step's end the core takes the
    first one and then whatever the sender has managed to start writing by the time it polls
    again: a race, one request in some steps and several in others (issue 19, ``vlm_mix`` at
    budget 4096: four image requests arrived during one 1 s step and went into the next two
    steps, two and two). Read ahead, every request sent before a step starts is there when it
    starts, as in vLLM's engine core (its input thread decodes requests into a queue the busy
    loop drains each step).
    """
    buffer = QueueChannel()

    def pump() -> None:
        try:
            while True:
                buffer.send(channel.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # an unreadable message: end the channel, saying why
            logger.exception("%s: could not read a message; closing the channel", name)
        finally:
            buffer.close()

    threading.Thread(target=pump, name=name, daemon=True).start()
    return buffer
