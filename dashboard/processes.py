"""Child processes of the dashboard: the embedded collector and engine, and load generator runs.

No orphans, however the dashboard ends:

- every child is started from one long-lived thread (:class:`_Spawner`) with
  ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` in its ``preexec_fn``, so the kernel sends it SIGTERM when
  the dashboard process dies, even by SIGKILL (the signal follows the *thread* that forked, which
  is why Streamlit's short-lived script threads must not fork);
- an ``atexit`` hook stops them (SIGTERM, then SIGKILL after a grace period) when Streamlit exits
  normally, which is what its own SIGTERM / SIGINT handlers make it do;
- each child runs in its own session, so a terminal's Ctrl-C reaches only the dashboard, which
  then stops them in order.

A child's stdout and stderr go to a log file in the data folder (appended: earlier starts stay
above); its ready line is read back with ``wire.ready.ready_url`` from the bytes written since
this start only (an older start's line names a port nobody listens on any more; ports are
picked by the children: ``--port 0``). This is not
``wire.ready.ReadyWatch`` (a pipe read by a thread, the tests' and benchmarks' launcher): a
dashboard child outlives the script run that started it and writes for hours, so its output goes
to a file no thread has to keep draining, that the sidebar's log view reads and that is still
there after a crash.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import functools
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wire.ready import ready_url

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 5.0


def _die_with_parent(parent: int, priority: int | None = None) -> None:  # in the child, before exec
    # The forking thread may run nicer than the dashboard (a page run that yielded the CPU
    # started the spawner): the child takes the priority it was meant to have, not its thread's.
    if priority is not None:
        try:
            if os.getpriority(os.PRIO_PROCESS, 0) != priority:
                os.setpriority(os.PRIO_PROCESS, 0, priority)
        except OSError:
            pass  # lowering nice needs CAP_SYS_NICE: the spawner is made at import to avoid it
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    os.setsid()


def base_priority() -> int:
    """The dashboard's own nice value: its main thread's (page runs may run nicer)."""
    return os.getpriority(os.PRIO_PROCESS, os.getpid()) if hasattr(os, "getpriority") else 0


PAGE_NICE = 5  # how much nicer than the engine the dashboard's page runs are


def yield_cpu(nice: int = PAGE_NICE) -> None:
    """Make the calling thread (a Streamlit page or fragment run) ``nice`` nicer, once: on
    Linux nice is per thread, so the dashboard's redraws give way to the engine it measures on a
    small machine while its web server thread keeps answering clicks. Elsewhere nothing."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return
    tid = threading.get_native_id()
    try:
        want = os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice  # the main thread's, + nice
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)
    except OSError:
        pass


class _Spawner:
    """One daemon thread that lives as long as the process and does every fork."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.Queue()
        )
        self._thread = threading.Thread(target=self._loop, name="dashboard-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def call(self, fn: Callable[[], Any]) -> Any:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, fut))
        return fut.result(timeout=30)


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()
_children: list[ManagedProcess] = []
_children_lock = threading.Lock()


def _get_spawner() -> _Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
            atexit.register(stop_all)
        return _spawner


@dataclass
class ManagedProcess:
    """A child process with its log file; ``state`` is what the sidebar shows."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    stopped: bool = False
    log_offset: int = 0  # size of the log when this start began: its output comes after
    # > 0: the child runs this much nicer than the dashboard, so that on a small machine the
    # engine being measured gets the CPU before the instruments watching or loading it
    nice: int = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        if rc is None:
            return "stopping" if self.stopped else "running"
        return "stopped" if self.stopped else f"exited ({rc})"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: Mapping[str, str | None] | None = None) -> ManagedProcess:
        """Start the child with this process's environment plus ``env`` (a None value removes
        the variable: how a child is kept from credentials it does not need)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it after the fork
        self.log_offset = log.seek(0, os.SEEK_END)
        self.url = None
        self.error = None
        self.stopped = False
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env = {k: v for k, v in merged.items() if v is not None}

        parent = os.getpid()
        priority = min(base_priority() + self.nice, 19)

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                # spawner thread only
                preexec_fn=functools.partial(_die_with_parent, parent, priority),
                close_fds=True,
            )

        try:
            self.proc = _get_spawner().call(spawn)
        finally:
            log.close()
        self.started_at = time.time()
        with _children_lock:
            _children.append(self)
        logger.info("started %s (pid %s): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    def wait_ready(self, pattern: re.Pattern[str], timeout: float) -> str:
        """Block until the log shows ``pattern`` (returns its first group); ``RuntimeError``
        with the log's tail if the child exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            url = ready_url(self.log_since_start(64_000), pattern)
            if url is not None:
                self.url = url
                return url
            if not self.alive():
                self.error = f"{self.name} exited ({self.returncode}) before it was ready"
                raise RuntimeError(f"{self.error}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.error = f"{self.name} not ready after {timeout:g} s"
                self.stop()
                raise RuntimeError(f"{self.error}:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_since_start(self, nbytes: int) -> str:
        """The first ``nbytes`` this start wrote to the log (where its ready line is)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read(nbytes).decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - nbytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def send(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = STOP_GRACE_S, sig: int = signal.SIGTERM) -> int | None:
        """SIGTERM (or ``sig``), wait up to ``grace`` seconds, then SIGKILL; idempotent."""
        self.stopped = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.send(sig)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM; killing it", self.name, self.pid)
                self.proc.kill()
                try:
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    logger.error("%s (pid %s) survived SIGKILL", self.name, self.pid)
        return self.proc.returncode


def stop_all() -> None:
    """Stop every child still running, newest first (engine before collector)."""
    with _children_lock:
        children = list(reversed(_children))
    for child in children:
        if child.alive():
            child.stop()


def python_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


# Made at import, before any page run can call yield_cpu: a thread inherits its creator's nice
# value, and a spawner made by a page run that yielded would start the engine nicer than the
# browser drawing it (the child could not take it back without CAP_SYS_NICE).
_get_spawner()
