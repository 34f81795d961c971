"""A dependency-free progress bar on stderr (redrawn in place on a TTY, periodic lines if not)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

logger = logging.getLogger(__name__)


class Progress:
    def __init__(
        self,
        total: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        width: int = 30,
        line_every_s: float = 5.0,
    ) -> None:
        self.total, self.enabled, self.width = max(total, 0), enabled, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.line_every_s = line_every_s
        self._t0 = time.perf_counter()
        self._last_line = -1e9

    def update(self, sent: int, done: int, errors: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        text = (
            f"[{bar}] {done}/{self.total} done  sent {sent}  in flight {sent - done}  "
            f"errors {errors}  {now - self._t0:6.1f}s"
        )
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
            self.stream.flush()
        elif final or now - self._last_line >= self.line_every_s:
            self._last_line = now
            self.stream.write(text + "\n")
            self.stream.flush()
