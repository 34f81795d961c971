"""Incremental Server-Sent Events parser (WHATWG rules), robust to how bytes are split.

Handles `\\n`, `\\r\\n` and `\\r` line ends (also a `\\r\\n` split across reads), multi-line `data`
(joined with `\\n`), comment lines starting with `:`, `event:` names, fields without a value, and
a missing space after the colon. An event is dispatched at a blank line; `flush()` returns the
unterminated tail at end of stream so a cut stream can be told apart from a clean one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_BUFFER = 16 * 1024 * 1024  # a line longer than this is a protocol error


class SSEError(ValueError):
    """The byte stream is not valid SSE (e.g. an unbounded line)."""


@dataclass(frozen=True)
class Event:
    data: str
    event: str = "message"


class SSEParser:
    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event = ""
        self._has_fields = False

    def feed(self, chunk: bytes) -> list[Event]:
        """Parse a read's bytes; return the events completed by it."""
        buf = self._buf + chunk if self._buf else chunk
        events: list[Event] = []
        start, n = 0, len(buf)
        while start < n:
            nl = buf.find(b"\n", start)
            cr = buf.find(b"\r", start, nl if nl >= 0 else n)
            if cr >= 0:
                if cr == n - 1:  # may be the first half of a \r\n split across reads
                    break
                end, nxt = cr, cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            elif nl >= 0:
                end, nxt = nl, nl + 1
            else:
                break
            self._line(buf[start:end], events)
            start = nxt
        self._buf = buf[start:]
        if len(self._buf) > MAX_BUFFER:
            raise SSEError(f"SSE line longer than {MAX_BUFFER} bytes")
        return events

    def _line(self, raw: bytes, events: list[Event]) -> None:
        if not raw:
            if self._has_fields and self._data:
                events.append(Event("\n".join(self._data), self._event or "message"))
            self._data, self._event, self._has_fields = [], "", False
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        self._has_fields = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        # `id` and `retry` are irrelevant to a one-shot completion stream

    def flush(self) -> tuple[list[Event], bool]:
        """At end of stream: (events, clean). A trailing `\\r` ends its line; an event without
        its blank line is still returned but `clean` is False (the stream was cut)."""
        events: list[Event] = []
        if self._buf:
            tail = self._buf.rstrip(b"\r")
            had_tail = True
            self._buf = b""
            if tail:
                self._line(tail, events)
        else:
            had_tail = False
        pending = bool(self._has_fields and self._data)
        if pending:
            events.append(Event("\n".join(self._data), self._event or "message"))
            self._data, self._event, self._has_fields = [], "", False
        return events, not pending and not (had_tail and events)
