"""The line a child server prints once it listens, and how a launcher reads its URL from it.

``python -m engine`` prints :func:`engine_ready_line` (on stderr) and ``python -m storage serve``
:func:`collector_ready_line` (on stdout) when their sockets accept connections; every launcher
(tests, benchmarks, the dashboard) waits for it with :data:`ENGINE_READY` / :data:`COLLECTOR_READY`.
"""

from __future__ import annotations

import re

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
