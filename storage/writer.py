"""The writer thread: the only code that writes to the store.

Async handlers call ``Writer.submit(op)`` (constant time, never blocks); the thread takes
everything queued (up to ``max_batch_events`` events; when the previous write started less than
``min_commit_interval`` seconds ago, what comes until then too), applies it in one transaction
(``Store.apply``) and reports ``(ops, results, seconds)`` through ``on_commit`` after the commit.
If a batch fails, each op is retried alone so one bad op cannot take the others down, for at most
``retry_deadline`` seconds in all (an outage fails every op alike, and each try may wait for a
timeout: the ops not tried by then fail with the batch's exception); an op that
still fails gets its exception as its result, and so does every later ``Events`` op of the same
run in that batch (not applied: a run's durable seq never moves past events it failed to store;
the collector closes that connection and the engine resends from the durable seq). An ``Events``
op of a later batch that was queued behind the failed one is refused by the store itself
(``SeqHole`` as its result) for the same reason, even once the fault has cleared. The latest
outcome is kept for ``/healthz``: ``last_error`` (set as soon as a batch fails, before the
retries; None once a batch with events commits again), ``alive``, and :meth:`Writer.problem`, which
also reports a batch that has waited on the store longer than ``stall_after`` seconds.

On SQLite the writer's connection does not checkpoint the WAL itself: a checkpoint copies the
WAL into the database file and syncs it, which can take a few hundred milliseconds on a slow
disk, and every commit waiting behind it would delay its acks. A second thread with its own
connection runs a PASSIVE checkpoint (never blocks the writer or readers) every
``checkpoint_interval`` seconds instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from storage.store import DEFAULT_MAX_RUNS_PER_ENGINE, DEFAULT_RUNS_WINDOW, Events, Store

logger = logging.getLogger(__name__)

_STOP = object()

CommitCallback = Callable[[list[Any], list[Any], float], None]

DEFAULT_RETRY_DEADLINE = 5.0  # seconds for the op-by-op retries of one failed batch, in all
DEFAULT_STALL_AFTER = 2.0  # a batch waiting on the store this long is reported
# Writes start at most this often: under a steady stream (many engines, a frame each every
# few ms) a transaction takes the frames of this long instead of one or two, so the statements
# and the commit of a batch are paid per interval, not per frame. Acks wait for it at most.
DEFAULT_MIN_COMMIT_INTERVAL = 0.05


class Writer:
    def __init__(
        self,
        db: Engine,
        on_commit: CommitCallback,
        *,
        max_batch_events: int = 50_000,
        min_commit_interval: float = DEFAULT_MIN_COMMIT_INTERVAL,
        checkpoint_interval: float = 1.0,
        retry_deadline: float = DEFAULT_RETRY_DEADLINE,
        stall_after: float = DEFAULT_STALL_AFTER,
        max_runs_per_engine: int | None = DEFAULT_MAX_RUNS_PER_ENGINE,
        runs_window: float = DEFAULT_RUNS_WINDOW,
    ) -> None:
        self.retry_deadline = retry_deadline
        self.min_commit_interval = min_commit_interval
        self._last_write = 0.0  # monotonic start of the latest write
        self.stall_after = stall_after
        self._busy_since: float | None = None  # monotonic start of the batch being written
        self.db = db
        self._sqlite = db.dialect.name == "sqlite"
        self.store = Store(
            db,
            sqlite_autocheckpoint=not self._sqlite,
            max_runs_per_engine=max_runs_per_engine,
            runs_window=runs_window,
        )
        self._checkpoint_interval = checkpoint_interval
        self._stopping = threading.Event()
        self._checkpointer: threading.Thread | None = None
        self._on_commit = on_commit
        self._max_batch_events = max_batch_events
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None  # why the latest batch failed; None: it committed

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def problem(self) -> str:
        """Why the store is not healthy as the writer sees it ("" when it is): the latest batch
        failed, or the one being written has waited on the store over ``stall_after`` s."""
        if self.last_error:
            return self.last_error
        since = self._busy_since
        if since is not None:
            waited = time.monotonic() - since
            if waited > self.stall_after:
                return f"no answer from the store for {waited:.0f} s (a batch waits on it)"
        return ""

    def start(self) -> None:
        n = self.store.startup()
        if n:
            logger.info(
                "%d run(s) were connected when the collector stopped: marked ended "
                "without goodbye until they reconnect",
                n,
            )
        self._thread = threading.Thread(target=self._run, name="storage-writer", daemon=True)
        self._thread.start()
        if self._sqlite:
            self._checkpointer = threading.Thread(
                target=self._checkpoints, name="storage-checkpoint", daemon=True
            )
            self._checkpointer.start()

    def _checkpoints(self) -> None:
        with self.db.connect() as conn:
            while not self._stopping.wait(self._checkpoint_interval):
                try:
                    conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
                    conn.commit()
                except Exception:
                    logger.exception("WAL checkpoint failed")
            try:  # a last full one, so the database file holds everything
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.commit()
            except Exception:
                logger.exception("final WAL checkpoint failed")

    def submit(self, op: Any) -> None:
        self._queue.put(op)

    def stop(self, timeout: float = 30.0) -> None:
        """Write everything queued, then stop the thread and close the connection."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("writer did not stop within %.0f s", timeout)
        self._thread = None
        self._stopping.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout)
            self._checkpointer = None

    def _run(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is _STOP:
                    return
                ops = [first]
                n = len(first.events) if isinstance(first, Events) else 1
                stop = False
                # group commit: at most one transaction per min_commit_interval; a write that
                # comes after a quiet spell starts at once
                until = self._last_write + self.min_commit_interval
                while n < self._max_batch_events:
                    try:
                        op = self._queue.get_nowait()
                    except queue.Empty:
                        left = until - time.monotonic()
                        if left <= 0:
                            break
                        try:
                            op = self._queue.get(timeout=left)
                        except queue.Empty:
                            break
                    if op is _STOP:
                        stop = True
                        break
                    ops.append(op)
                    n += len(op.events) if isinstance(op, Events) else 1
                self._last_write = time.monotonic()
                self._write(ops)
                if stop:
                    return
        finally:
            self.store.close()

    def _write(self, ops: list[Any]) -> None:
        t0 = time.perf_counter()
        self._busy_since = time.monotonic()
        try:
            self._write_batch(ops, t0)
        finally:
            self._busy_since = None

    def _write_batch(self, ops: list[Any], t0: float) -> None:
        try:
            results = self.store.apply(ops)
            if any(isinstance(op, Events) for op in ops):
                self.last_error = None  # events commit again
        except Exception as batch_exc:
            self.last_error = f"{type(batch_exc).__name__}: {str(batch_exc)[:200]}"
            logger.exception(
                "writing a batch of %d operations failed; retrying one by one", len(ops)
            )
            results = []
            failed_runs: dict[int, BaseException] = {}
            n_failed = 0
            deadline = time.monotonic() + self.retry_deadline
            for i, op in enumerate(ops):
                if time.monotonic() > deadline:
                    left = len(ops) - i
                    logger.error(
                        "retrying one by one ran past %g s: %d operation(s) fail untried",
                        self.retry_deadline,
                        left,
                    )
                    results.extend([batch_exc] * left)
                    n_failed += left
                    break
                run_key = op.run_key if isinstance(op, Events) else None
                if run_key is not None and run_key in failed_runs:
                    results.append(failed_runs[run_key])  # never past a seq that failed
                    n_failed += 1
                    continue
                try:
                    results.append(self.store.apply([op])[0])
                except Exception as exc:
                    logger.exception("operation %s failed", type(op).__name__)
                    results.append(exc)
                    n_failed += 1
                    if run_key is not None:
                        failed_runs[run_key] = exc
            self.last_error = (
                f"{type(batch_exc).__name__}: {str(batch_exc)[:200]}" if n_failed else None
            )
        try:
            self._on_commit(ops, results, time.perf_counter() - t0)
        except Exception:
            logger.exception("commit callback failed")
