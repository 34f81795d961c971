"""A collector to talk to, for tests and benchmarks (no torch).

- ``start_collector`` / ``CollectorProcess``: ``python -m storage --port 0`` as a subprocess on a
  given database, its URL read back from its ready line (``wire.ready``); ``stop()`` ends it.
- ``collector_in_thread``: the same collector inside this process (faster for unit tests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wire.ready import COLLECTOR_READY, ReadyWatch

# ---- a collector to talk to -------------------------------------------------------------------


@dataclass
class CollectorProcess:
    """A collector subprocess: ``url`` (ws://127.0.0.1:PORT), ``db_url`` and the process."""

    url: str
    db_url: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def http_url(self) -> str:
        return "http" + self.url[2:]

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last commit."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (a clean shutdown that writes what is queued), then SIGKILL if needed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return int(self.process.returncode)


def start_collector(
    db_url: str,
    *,
    args: list[str] | None = None,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    tree: str | Path | None = None,
) -> CollectorProcess:
    """``python -m storage --port 0 --db DB_URL [args]``; returns once it listens. ``tree``:
    another checkout whose packages come first on the path (default: this one)."""
    cmd = [sys.executable, "-m", "storage", "--port", "0", "--db", db_url, *(args or [])]
    root = Path(tree).resolve() if tree is not None else Path(__file__).resolve().parent.parent
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), full_env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=str(cwd or root),
    )
    assert proc.stdout is not None
    watch = ReadyWatch(proc.stdout, COLLECTOR_READY)
    url = watch.wait(timeout)
    if url is None:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"collector did not start within {timeout} s: {cmd}\n" + watch.tail(30))
    return CollectorProcess(url=url, db_url=db_url, process=proc, lines=watch.lines)


@contextlib.contextmanager
def collector_in_thread(db_url: str, **options: Any) -> Iterator[Any]:
    """A ``storage.collector.Collector`` on 127.0.0.1 port 0 in a background thread's event
    loop; yields it (``.url``, ``.port``). Options are ``CollectorConfig`` fields."""
    import asyncio

    from storage.collector import Collector, CollectorConfig

    config = CollectorConfig(db_url=db_url, host="127.0.0.1", port=0, **options)
    collector = Collector(config)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(collector.start())
        except BaseException as exc:  # surfaced to the caller below
            errors.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="collector", daemon=True)
    thread.start()
    if not started.wait(60) or errors:
        raise RuntimeError(f"collector did not start: {errors[:1]}")
    try:
        yield collector
    finally:
        fut = asyncio.run_coroutine_threadsafe(collector.stop(), loop)
        fut.result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
