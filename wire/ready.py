"""The line a child server prints once it listens, and how a launcher reads its URL from it.

``python -m engine`` prints :func:`engine_ready_line` (on stderr) and ``python -m storage serve``
:func:`collector_ready_line` (on stdout) when their sockets accept connections; every launcher
(tests, benchmarks, the dashboard) waits for it with :data:`ENGINE_READY` / :data:`COLLECTOR_READY`.
"""

from __future__ import annotations

import re
import threading
from typing import IO

ENGINE_READY = re.compile(r"chunkscope engine listening on (https?://[^\s,]+)")
COLLECTOR_READY = re.compile(r"collector listening on (wss?://[^\s,]+)")


def engine_ready_line(host: str, port: int) -> str:
    return f"chunkscope engine listening on http://{host}:{port}"


def collector_ready_line(url: str) -> str:
    return f"collector listening on {url}"


def ready_url(text: str, pattern: re.Pattern[str]) -> str | None:
    """The URL in ``text`` (a line or a log) announced by ``pattern``'s ready line, or None."""
    m = pattern.search(text)
    return m.group(1) if m else None


class ReadyWatch:
    """Reads a child's output on a daemon thread for as long as the child writes (so it never
    blocks on a full pipe), keeping its lines (the last ``keep`` when given), and notes the URL of
    the first ready line. The one "start a child, wait until it listens" plumbing of the tests,
    the test kit and the benchmarks."""

    def __init__(self, stream: IO[str], pattern: re.Pattern[str], keep: int | None = None):
        self.pattern = pattern
        self.lines: list[str] = []
        self.url: str | None = None
        self._keep = keep
        self._event = threading.Event()
        self._stream = stream
        threading.Thread(target=self._pump, name="ready-watch", daemon=True).start()

    def _pump(self) -> None:
        for line in self._stream:
            self.lines.append(line.rstrip("\n"))
            if self._keep is not None and len(self.lines) > 2 * self._keep:
                del self.lines[: -self._keep]
            if self.url is None:
                self.url = ready_url(line, self.pattern)
                if self.url is not None:
                    self._event.set()
        self._event.set()  # the child closed its output: it will not become ready

    def wait(self, timeout: float) -> str | None:
        """The URL once the ready line came, or None (the child ended or ``timeout`` passed)."""
        self._event.wait(timeout)
        return self.url

    def tail(self, n: int) -> str:
        return "\n".join(self.lines[-n:])
