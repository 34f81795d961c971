"""Fake engine -> collector -> database -> queries, on SQLite and PostgreSQL: what the engine
did is what the queries return (token times exact), resends never double a row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from storage import db as dbm
from storage import queries
from testkit.engines import FakeEngineClient, SyntheticEngine, frames

from .helpers import run_row, stored_seqs, wait_until


def _expected_seqs(engine: SyntheticEngine, skip: set[int]) -> list[int]:
    return [s for s in range(1, engine.seq + 1) if s not in skip]


def test_round_trip(collector: Any, db_url: str) -> None:
    eng = SyntheticEngine(engine_id="engine-rt", run_id="run-rt", seed=7, concurrency=12)
    hello = eng.hello
    eng.hello = lambda token=None: {**hello(token), "core_pid": 1, "future_hello_field": [1]}
    client = FakeEngineClient(collector.url, eng)
    assert client.connect() == 0
    events = eng.steps(150)
    # a newer engine: unknown fields on a step, a chunk, a request event and the frame
    step = next(e for e in events if e["type"] == "step" and e["chunks"])
    step["future_field"] = {"x": 1}
    step["chunks"][0]["future_chunk_field"] = 3
    next(e for e in events if e["type"] == "request")["future"] = "yes"
    for frame in frames(eng, events, per_frame=50):
        frame["sent_by"] = "a newer publisher"
        client.send(frame)
    client.wait_ack(eng.seq)
    bye = eng.goodbye()
    client.send_events([bye])
    assert client.wait_ack(eng.seq) == eng.seq
    client.close()
    assert client.errors == []

    db = dbm.connect(db_url, readonly=True)
    try:
        runs = queries.engines(db)
        assert len(runs) == 1
        run = runs.iloc[0]
        assert (run.engine_id, run.run_id, run.model) == ("engine-rt", "run-rt", "synthetic")
        assert run.num_steps == 150 and run.last_step == 149
        assert bool(run.ended_without_goodbye) is False and run.ended is not None
        wait_until(lambda: not queries.engines(db).iloc[0].connected, what="disconnect stored")

        st = queries.steps(db, engine_id="engine-rt")
        sent_steps = [e for e in events if e["type"] == "step"]
        assert list(st.step) == list(range(150))
        assert list(st.num_scheduled_tokens) == [e["num_scheduled_tokens"] for e in sent_steps]
        assert list(st.start_ns) == [e["start_ns"] for e in sent_steps]
        np.testing.assert_allclose(st.start, [eng.wall(e["start_ns"]) for e in sent_steps])
        np.testing.assert_allclose(
            st.duration_ms, [(e["end_ns"] - e["start_ns"]) / 1e6 for e in sent_steps]
        )
        assert list(st.num_chunks) == [len(e["chunks"]) for e in sent_steps]

        ch = queries.step_chunks(
            db, engine_id="engine-rt", run_id="run-rt", step_from=10, step_to=12
        )
        want = [
            (
                e["step"],
                i,
                c["request_id"],
                c["kind"],
                c["start"],
                c["num_tokens"],
                c["produced_token"],
            )
            for e in sent_steps[10:13]
            for i, c in enumerate(e["chunks"])
        ]
        got = list(
            ch[
                ["step", "idx", "request_id", "kind", "start", "num_tokens", "produced_token"]
            ].itertuples(index=False, name=None)
        )
        assert got == want
        assert set(ch.traffic_class) <= {"chat", "rag", "vlm"}

        # token times are exact: the k-th token is the end of its k-th producing step
        for rid, times in eng.truth.items():
            tt = queries.token_times(db, engine_id="engine-rt", request_id=rid)
            assert list(tt.time_ns) == times, rid
            assert list(tt.k) == list(range(1, len(times) + 1))
        itl = queries.token_itl(db, engine_id="engine-rt")
        assert len(itl) == sum(max(0, len(t) - 1) for t in eng.truth.values())
        assert itl.time.is_monotonic_increasing
        one = next(rid for rid, t in eng.truth.items() if len(t) >= 3)
        mine = itl[itl.request_id == one].sort_values("k")
        np.testing.assert_allclose(mine.itl_ms, np.diff(eng.truth[one]) / 1e6)

        reqs = queries.requests(db, engine_id="engine-rt")
        assert set(reqs.request_id) == set(eng.truth)
        row = reqs.set_index("request_id").loc[one]
        times = eng.truth[one]
        assert row.num_output_tokens == len(times)
        assert row.first_token == pytest.approx(eng.wall(times[0]))
        assert row.tpot_ms == pytest.approx((times[-1] - times[0]) / (len(times) - 1) / 1e6)
        assert row.max_itl_ms == pytest.approx(max(np.diff(times)) / 1e6)

        summary = queries.latency_summary(db, engine_id="engine-rt").set_index("traffic_class")
        assert list(summary.index) == ["chat", "rag", "vlm", "all"]
        assert summary.loc["all", "output_tokens"] == sum(len(t) for t in eng.truth.values())
        assert summary.loc["all", "num_gaps"] == 0
        assert summary.loc["all", "itl_max_ms"] == pytest.approx(itl.itl_ms.max())
    finally:
        db.dispose()
    # every seq stored exactly once (the goodbye is kept on the run, not as a row)
    assert stored_seqs(db_url, "engine-rt", "run-rt") == _expected_seqs(eng, {bye["seq"]})
    assert run_row(db_url, "engine-rt", "run-rt")["last_seq"] == eng.seq


def test_resend_never_doubles_a_row(collector: Any, db_url: str) -> None:
    eng = SyntheticEngine(engine_id="engine-dup", run_id="run-dup", seed=3)
    events = eng.steps(40)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(events, per_frame=16)
    client.wait_ack(eng.seq)
    client.send_events(events, per_frame=16)  # the same frames again, same connection
    client.send_events(events[-5:])
    more = eng.steps(5)
    client.send_events(events[-3:] + more)  # overlapping resend: old part skipped, new stored
    client.wait_ack(eng.seq)
    client.close()
    # a reconnect learns the durable seq, and resending everything changes nothing
    again = FakeEngineClient(collector.url, eng)
    assert again.connect() == eng.seq
    again.send_events(events + more, per_frame=100)
    again.send_events(eng.steps(2))
    again.wait_ack(eng.seq)
    again.close()
    assert again.errors == [] and client.errors == []
    assert stored_seqs(db_url, "engine-dup", "run-dup") == list(range(1, eng.seq + 1))
    db = dbm.connect(db_url, readonly=True)
    try:
        assert list(queries.steps(db, run_id="run-dup").step) == list(range(47))
        for rid, times in eng.truth.items():
            assert list(queries.token_times(db, request_id=rid).time_ns) == times
    finally:
        db.dispose()


def test_gap_event_jumps_over_lost_seqs(collector: Any, db_url: str) -> None:
    eng = SyntheticEngine(engine_id="engine-gap", run_id="run-gap", seed=5)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    events = eng.steps(5)
    first_lost = eng.seq + 1
    eng.gap(first_lost, first_lost + 9)
    events += eng.steps(5)
    client.send_events(events)
    assert client.wait_ack(eng.seq) == eng.seq
    client.close()
    assert client.errors == []
    lost = set(range(first_lost, first_lost + 10))
    assert stored_seqs(db_url, "engine-gap", "run-gap") == _expected_seqs(eng, lost)
    db = dbm.connect(db_url, readonly=True)
    try:
        g = queries.gaps(db, engine_id="engine-gap")
        assert list(g[["first_seq_lost", "last_seq_lost", "num_events_lost"]].iloc[0]) == [
            first_lost,
            first_lost + 9,
            10,
        ]
        assert queries.engines(db).iloc[0].num_gap_events == 1
        assert set(queries.latency_summary(db).num_gaps) == {1}
    finally:
        db.dispose()


def test_disconnect_without_goodbye_then_reconnect(collector: Any, db_url: str) -> None:
    eng = SyntheticEngine(engine_id="engine-drop", run_id="run-drop", seed=9)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(eng.steps(10))
    client.wait_ack(eng.seq)
    client.close()  # no goodbye
    wait_until(
        lambda: run_row(db_url, "engine-drop", "run-drop").get("ended_without_goodbye"),
        what="ended_without_goodbye",
    )
    assert not run_row(db_url, "engine-drop", "run-drop")["connected"]
    client = FakeEngineClient(collector.url, eng)
    assert client.connect() == eng.seq
    wait_until(lambda: run_row(db_url, "engine-drop", "run-drop")["connected"], what="connected")
    assert not run_row(db_url, "engine-drop", "run-drop")["ended_without_goodbye"]
    client.send_events(eng.steps(3) + [eng.goodbye()])
    client.wait_ack(eng.seq)
    client.close()
    wait_until(lambda: not run_row(db_url, "engine-drop", "run-drop")["connected"], what="closed")
    row = run_row(db_url, "engine-drop", "run-drop")
    assert row["ended"] is not None and not row["ended_without_goodbye"]
    assert row["num_steps"] == 13


def test_many_engines_one_collector(collector: Any, db_url: str) -> None:
    import threading

    engines = [
        SyntheticEngine(engine_id=f"engine-{i}", run_id=f"run-{i}", seed=i) for i in range(4)
    ]

    def stream(eng: SyntheticEngine) -> None:
        client = FakeEngineClient(collector.url, eng)
        client.connect()
        for _ in range(5):
            client.send_events(eng.steps(10), per_frame=20)
        client.wait_ack(eng.seq, timeout=30)
        client.close()

    threads = [threading.Thread(target=stream, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    db = dbm.connect(db_url, readonly=True)
    try:
        runs = queries.engines(db)
        assert sorted(runs.engine_id) == [f"engine-{i}" for i in range(4)]
        assert set(runs.num_steps) == {50}
        for eng in engines:
            assert stored_seqs(db_url, eng.engine_id, eng.run_id) == list(range(1, eng.seq + 1))
    finally:
        db.dispose()


def test_a_reader_never_blocks_the_writer(collector_factory: Any, sqlite_url: str) -> None:
    """A dashboard holding a read transaction open (WAL snapshot) while the collector writes."""
    collector = collector_factory(sqlite_url)
    eng = SyntheticEngine(engine_id="engine-r", run_id="run-r", seed=4)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(eng.steps(5))
    client.wait_ack(eng.seq)
    import sqlite3

    path = sqlite_url.removeprefix("sqlite:///")
    reader = sqlite3.connect(path, isolation_level=None, timeout=10)
    db = dbm.connect(sqlite_url, readonly=True)
    try:
        reader.execute("BEGIN")  # a read transaction: its snapshot stays until COMMIT
        seen = reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
        assert seen == 5
        client.send_events(eng.steps(20))
        assert client.wait_ack(eng.seq) == eng.seq  # committed while the read is open
        assert reader.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 5
        assert len(queries.steps(db)) == 25  # a new reader sees the new rows
        reader.execute("COMMIT")
    finally:
        reader.close()
        db.dispose()
        client.close()


def test_backpressure_when_the_writer_falls_behind(collector_factory: Any, sqlite_url: str) -> None:
    """Handlers stop reading while too many events wait for the writer; nothing is lost."""
    collector = collector_factory(sqlite_url, max_pending_events=5)
    eng = SyntheticEngine(engine_id="engine-bp", run_id="run-bp", seed=12)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(eng.steps(60), per_frame=10)
    assert client.wait_ack(eng.seq, timeout=30) == eng.seq
    client.close()
    assert stored_seqs(sqlite_url, "engine-bp", "run-bp") == list(range(1, eng.seq + 1))
