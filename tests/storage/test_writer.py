"""The writer when a store operation fails: it never moves a run's durable seq past events it
failed to store, and says so for ``/healthz`` (issue 18). Driven directly, no server."""

from __future__ import annotations

import sqlite3
import threading
import time
from typing import Any

from sqlalchemy import select

from storage import db as dbm
from storage import schema
from storage.store import Events, EventsResult, Hello, RunInfo, SeqHole
from storage.writer import Writer
from testkit.engines import SyntheticEngine

from .helpers import stored_seqs


def test_a_failed_op_stops_its_run_until_the_engine_resends(sqlite_url: str) -> None:
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    commits: list[tuple[list[Any], list[Any]]] = []
    writer = Writer(db, lambda ops, results, _s: commits.append((ops, results)))
    a = SyntheticEngine(engine_id="a", run_id="ra", seed=1)
    b = SyntheticEngine(engine_id="b", run_id="rb", seed=2)
    writer._write([Hello(a.hello()), Hello(b.hello())])  # one batch, as the thread would
    info_a, info_b = commits[-1][1]
    assert isinstance(info_a, RunInfo) and isinstance(info_b, RunInfo)
    ev_a, ev_b = a.steps(6), b.steps(2)
    third = len(ev_a) // 3
    parts = [ev_a[:third], ev_a[third : 2 * third], ev_a[2 * third :]]
    poison = Events(info_a.run_key, parts[1])
    original = writer.store.apply

    def apply(ops: list[Any]) -> list[Any]:
        if any(op is poison for op in ops):
            raise RuntimeError("disk I/O error")
        return original(ops)

    writer.store.apply = apply  # type: ignore[method-assign]
    ops = [
        Events(info_a.run_key, parts[0]),
        poison,
        Events(info_a.run_key, parts[2]),  # would succeed alone: must not be applied
        Events(info_b.run_key, ev_b),  # another run goes on
    ]
    writer._write(ops)
    results = commits[-1][1]
    assert isinstance(results[0], EventsResult) and results[0].last_seq == parts[0][-1]["seq"]
    assert isinstance(results[1], Exception) and isinstance(results[2], Exception)
    assert isinstance(results[3], EventsResult) and results[3].last_seq == ev_b[-1]["seq"]
    assert writer.last_error is not None and "disk I/O error" in writer.last_error
    # The engine resends from the durable seq: everything lands, once, and health comes back.
    writer.store.apply = original  # type: ignore[method-assign]
    writer._write([Events(info_a.run_key, parts[1] + parts[2])])
    [again] = commits[-1][1]
    assert isinstance(again, EventsResult) and again.last_seq == ev_a[-1]["seq"]
    assert again.duplicates == 0 and writer.last_error is None
    writer.store.close()
    db.dispose()


def test_an_integer_a_column_cannot_hold_is_one_bad_event_not_a_failed_batch(db_url: str) -> None:
    """On PostgreSQL an Integer column is 32-bit: one such value used to roll back the whole
    batch (every run in it onto the slow path); SQLite stored it. Now: refused, on both."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    commits: list[tuple[list[Any], list[Any]]] = []
    writer = Writer(db, lambda ops, results, _s: commits.append((ops, results)))
    a = SyntheticEngine(engine_id="a", run_id="ra", seed=1)
    b = SyntheticEngine(engine_id="b", run_id="rb", seed=2)
    writer._write([Hello(a.hello()), Hello(b.hello())])
    info_a, info_b = commits[-1][1]
    ev_a, ev_b = a.steps(4), b.steps(4)
    step_events = [e for e in ev_a if e["type"] == "step"]
    bad = step_events[1]
    bad["num_running"] = 2**31  # fits SQLite and int64, not PostgreSQL's Integer
    writer._write([Events(info_a.run_key, ev_a), Events(info_b.run_key, ev_b)])
    res_a, res_b = commits[-1][1]
    assert isinstance(res_a, EventsResult) and isinstance(res_b, EventsResult), commits[-1][1]
    assert [seq for seq, _ in res_a.bad] == [bad["seq"]]
    assert "num_running" in res_a.bad[0][1] and "outside what the store holds" in res_a.bad[0][1]
    assert res_a.last_seq == ev_a[-1]["seq"] and res_b.last_seq == ev_b[-1]["seq"]
    assert writer.last_error is None
    with db.connect() as c:
        rows = c.execute(select(schema.steps.c.run_key, schema.steps.c.num_running)).all()
    assert all(n != 2**31 for _, n in rows)
    assert len(rows) == len(step_events) - 1 + sum(e["type"] == "step" for e in ev_b)
    writer.store.close()
    db.dispose()


def test_a_frame_queued_behind_a_failed_one_never_moves_the_durable_seq_past_it(
    sqlite_url: str, monkeypatch: Any
) -> None:
    """A real fault that clears between batches: another connection holds SQLite's write lock
    past the busy timeout while frame N is written, then lets go before frame N+1 (queued behind
    N) is written. N+1 must not be stored on its own: the durable seq would jump over N, the
    ack would cover N, and nothing would say N is missing. Once the engine resends from the
    durable seq, every seq is stored exactly once."""
    monkeypatch.setattr(dbm, "BUSY_TIMEOUT_MS", 200)
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    commits: list[tuple[list[Any], list[Any]]] = []
    writer = Writer(db, lambda ops, results, _s: commits.append((ops, results)))
    eng = SyntheticEngine(engine_id="a", run_id="ra", seed=3)
    writer._write([Hello(eng.hello())])
    [info] = commits[-1][1]
    assert isinstance(info, RunInfo)
    first, n, after = eng.steps(3), eng.steps(3), eng.steps(3)
    writer._write([Events(info.run_key, first)])
    durable = first[-1]["seq"]
    assert commits[-1][1][0].last_seq == durable

    locker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        writer._write([Events(info.run_key, n)])
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    [failed] = commits[-1][1]
    assert isinstance(failed, Exception) and "locked" in str(failed)
    writer._write([Events(info.run_key, after)])  # the fault has cleared
    [late] = commits[-1][1]
    assert not isinstance(late, EventsResult) or late.last_seq == durable, (
        f"stored past seq {n[0]['seq']}, which was never stored"
    )
    assert isinstance(late, SeqHole) and late.expected == n[0]["seq"]
    assert _durable(db, info.run_key) == durable

    # the engine resends from the durable seq: everything lands, once
    writer._write([Events(info.run_key, n + after)])
    [again] = commits[-1][1]
    assert isinstance(again, EventsResult) and again.last_seq == after[-1]["seq"]
    assert stored_seqs(sqlite_url, "a", "ra") == list(range(1, eng.seq + 1))
    writer.store.close()
    db.dispose()


def _durable(db: Any, run_key: int) -> int:
    with db.connect() as c:
        return int(
            c.execute(select(schema.runs.c.last_seq).where(schema.runs.c.id == run_key)).scalar()
        )


def test_an_outage_fails_a_batch_within_the_retry_deadline_and_shows_at_once(
    sqlite_url: str,
) -> None:
    """A store that answers every statement only after a long wait (a network partition: each
    connect waits for its timeout) fails a batch of many operations within the retry deadline,
    not one wait per operation, and the outage is reported while the retries still run."""
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    commits: list[tuple[list[Any], list[Any]]] = []
    writer = Writer(db, lambda ops, results, _s: commits.append((ops, results)))
    writer.retry_deadline = 1.0
    seen_during_retry: list[str | None] = []

    def apply(ops: list[Any]) -> list[Any]:
        if len(ops) == 1:
            seen_during_retry.append(writer.last_error)
        time.sleep(0.4)
        raise OSError("could not connect: timeout expired")

    writer.store.apply = apply  # type: ignore[method-assign]
    ops = [Hello(SyntheticEngine(engine_id=f"e{i}", run_id="r", seed=i).hello()) for i in range(40)]
    t0 = time.monotonic()
    done = threading.Thread(target=writer._write, args=(ops,), daemon=True)
    done.start()
    done.join(10)
    assert not done.is_alive(), "the retries ran past 10 s (40 operations x 0.4 s)"
    assert time.monotonic() - t0 < 3.0
    [(_, results)] = commits
    assert len(results) == len(ops) and all(isinstance(r, Exception) for r in results)
    assert seen_during_retry and all(e and "timeout expired" in e for e in seen_during_retry)
    assert writer.last_error is not None
    writer.store.close()
    db.dispose()


def test_ops_that_come_within_the_commit_interval_of_a_write_join_the_next_one(
    sqlite_url: str,
) -> None:
    """Group commit: the first op after a quiet spell is written at once; ops that come while
    less than ``min_commit_interval`` has passed since that write start wait for one write
    together, and each still gets its own result after it."""
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    commits: list[tuple[list[Any], list[Any]]] = []
    done = threading.Event()

    def on_commit(ops: list[Any], results: list[Any], _s: float) -> None:
        commits.append((ops, results))
        done.set()

    writer = Writer(db, on_commit, min_commit_interval=3.0)
    eng = SyntheticEngine(engine_id="g", run_id="rg", seed=4)
    writer.start()
    try:
        writer.submit(Hello(eng.hello()))
        assert done.wait(10.0)
        [info] = commits[0][1]
        assert isinstance(info, RunInfo)
        events = eng.steps(9)
        parts = [events[: len(events) // 3], events[len(events) // 3 :]]
        done.clear()
        writer.submit(Events(info.run_key, parts[0]))
        time.sleep(0.3)  # the writer has long taken the first: without the interval, alone
        writer.submit(Events(info.run_key, parts[1]))
        assert done.wait(10.0)
    finally:
        writer.stop()
        db.dispose()
    assert len(commits) == 2  # the hello alone, then both frames in one transaction
    ops, results = commits[1]
    assert len(ops) == 2
    assert [r.last_seq for r in results] == [parts[0][-1]["seq"], parts[1][-1]["seq"]]
