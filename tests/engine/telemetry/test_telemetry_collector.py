"""The publisher against the real collector (``storage``), without an engine: a synthetic event
stream in, ``storage.queries`` out; a declared gap; goodbye marks the run ended."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from engine.telemetry import BufferLimits, Publisher
from storage import queries
from storage.db import connect
from testkit.collector import collector_in_thread, start_collector
from testkit.engines import SyntheticEngine
from tests.engine.telemetry.test_telemetry_publisher import WAIT_S, free_port, wait_until


def _hello(syn: SyntheticEngine) -> Any:
    fields = {k: v for k, v in syn.hello().items() if k not in ("engine_id", "run_id")}
    return lambda: fields


def _publisher(url: str, syn: SyntheticEngine, **kw: Any) -> Publisher:
    return Publisher(
        url, engine_id=syn.engine_id, run_id=syn.run_id, hello=_hello(syn), linger_s=0.01,
        backoff_initial_s=0.05, backoff_max_s=0.5, **kw,
    )  # fmt: skip


def test_synthetic_run_is_stored_once_and_ended_by_goodbye(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'c.db'}"
    syn = SyntheticEngine(engine_id="eng-syn", run_id="run-syn-1", seed=3)
    events = syn.steps(300)
    with collector_in_thread(db_url) as collector:
        pub = _publisher(collector.url, syn, max_batch_events=100).start()
        for ev in events:
            pub.publish({k: v for k, v in ev.items() if k != "seq"})
        assert pub.wait_acked(timeout=WAIT_S)
        assert pub.stats().acked_seq == len(events)
        pub.close(timeout=WAIT_S)
    db = connect(db_url, readonly=True)
    steps = queries.steps(db, engine_id="eng-syn")
    assert list(steps["step"]) == list(range(300))
    run = queries.engines(db).iloc[0]
    assert run["run_id"] == "run-syn-1" and run["ended"] is not None
    assert not run["ended_without_goodbye"]
    rid = next(r for r, t in syn.truth.items() if len(t) > 3)
    times = queries.token_times(db, engine_id="eng-syn", request_id=rid)
    assert list(times["time_ns"]) == syn.truth[rid]  # exact token times


def test_lost_events_reach_the_store_as_one_gap(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'g.db'}"
    port = free_port()
    syn = SyntheticEngine(engine_id="eng-gap", run_id="run-gap-1", seed=4)
    limits = BufferLimits(max_memory_events=50, max_spill_bytes=0)
    pub = _publisher(f"ws://127.0.0.1:{port}", syn, limits=limits).start()
    collector = None
    try:
        for ev in syn.steps(40):
            pub.publish({k: v for k, v in ev.items() if k != "seq"})
        lost = pub.stats().dropped_total
        assert lost > 0
        collector = start_collector(db_url, args=["--port", str(port)])
        wait_until(lambda: pub.connected, "connected")
        assert pub.wait_acked(timeout=WAIT_S)
        pub.publish({"type": "request", "kind": "arrived", "request_id": "late", "time_ns": 1})
        assert pub.wait_acked(timeout=WAIT_S)
        pub.close(timeout=WAIT_S)
    finally:
        pub.close(timeout=1)
        if collector is not None:
            collector.stop()
    db = connect(db_url, readonly=True)
    gaps = queries.gaps(db, engine_id="eng-gap")
    assert len(gaps) == 1
    gap = gaps.iloc[0]
    assert (gap["first_seq_lost"], gap["num_events_lost"]) == (51, lost)
    assert gap["last_seq_lost"] == 50 + lost and gap["seq"] == 51 + lost
    assert queries.engines(db).iloc[0]["num_gap_events"] == 1


class _Unencodable:
    def to_dict(self) -> dict[str, Any]:
        raise RuntimeError("broken")


def test_unknown_types_and_fields_pass_the_real_collector(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'u.db'}"
    syn = SyntheticEngine(engine_id="eng-new", run_id="run-new-1", seed=5)
    events = syn.steps(5)
    with collector_in_thread(db_url) as collector:
        pub = _publisher(collector.url, syn).start()
        for i, ev in enumerate(events):
            pub.publish({**{k: v for k, v in ev.items() if k != "seq"}, "from_a_newer_engine": i})
            if i == 3:
                pub.publish(_Unencodable())  # sent as type "unencodable": skipped, seq counted
        assert pub.wait_acked(timeout=WAIT_S)
        pub.close(timeout=WAIT_S)
    db = connect(db_url, readonly=True)
    assert list(queries.steps(db, engine_id="eng-new")["step"]) == list(range(5))
    # the one event the engine could not encode is the one seq not stored: a gap saying why
    [gap] = queries.gaps(db, engine_id="eng-new").itertuples()
    assert gap.num_events_lost == 1 and gap.first_seq_lost == gap.seq
    assert "unencodable" in gap.reason and "broken" in gap.reason


def test_the_collector_auth_token_is_sent_in_the_hello(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db_url = f"sqlite:///{tmp_path / 'a.db'}"
    syn = SyntheticEngine(engine_id="eng-auth", run_id="run-auth-1", seed=6)
    with collector_in_thread(db_url, auth_token="s3cret") as collector:
        good = _publisher(collector.url, syn, token="s3cret").start()
        bad = Publisher(
            collector.url, engine_id="eng-bad", hello=_hello(syn), token="wrong",
            backoff_initial_s=0.02, backoff_max_s=0.1,
        ).start()  # fmt: skip
        try:
            with caplog.at_level(logging.WARNING, logger="engine.telemetry"):
                for ev in syn.steps(3):
                    good.publish({k: v for k, v in ev.items() if k != "seq"})
                    bad.publish({k: v for k, v in ev.items() if k != "seq"})
                assert good.wait_acked(timeout=WAIT_S)
                wait_until(lambda: bad.stats().connect_failures >= 3, "refused connects")
            assert not bad.connected and bad.stats().acked_seq == 0
            assert "the collector refused the --publish-token (HTTP 401" in caplog.text
        finally:
            good.close(timeout=WAIT_S)
            bad.close(timeout=0.5)


def test_a_vanished_spill_file_reaches_the_store_as_a_gap(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'v.db'}"
    port = free_port()
    syn = SyntheticEngine(engine_id="eng-vanish", run_id="run-vanish-1", seed=7)
    limits = BufferLimits(max_memory_events=10, spill_dir=tmp_path / "spill")
    pub = _publisher(f"ws://127.0.0.1:{port}", syn, limits=limits).start()
    collector = None
    try:
        events = syn.steps(10)
        for ev in events:
            pub.publish({k: v for k, v in ev.items() if k != "seq"})
        for f in (tmp_path / "spill" / syn.run_id).glob("*.jsonl"):
            f.unlink()  # e.g. a temp cleaner
        collector = start_collector(db_url, args=["--port", str(port)])
        assert pub.wait_acked(timeout=WAIT_S)
        pub.publish({"type": "request", "kind": "arrived", "request_id": "after", "time_ns": 1})
        assert pub.wait_acked(timeout=WAIT_S)
        pub.close(timeout=WAIT_S)
    finally:
        pub.close(timeout=1)
        if collector is not None:
            collector.stop()
    db = connect(db_url, readonly=True)
    gaps = queries.gaps(db, engine_id="eng-vanish")
    assert len(gaps) == 1
    gap = gaps.iloc[0]
    assert (gap["first_seq_lost"], gap["last_seq_lost"]) == (11, len(events))
    run = queries.engines(db).iloc[0]
    assert not run["ended_without_goodbye"]


def test_an_engine_whose_run_was_deleted_declares_the_loss_and_goes_on(tmp_path: Path) -> None:
    """The collector restarts without the run (deleted by a prune while the engine was away):
    its hello is answered with durable seq 0, below what it acknowledged before. The engine
    declares the seqs it no longer holds lost in a gap and goes on streaming, instead of
    reconnecting forever on the collector's seq_gap."""
    from storage import retention

    db_url = f"sqlite:///{tmp_path / 'p.db'}"
    port = free_port()
    syn = SyntheticEngine(engine_id="eng-pruned", run_id="run-pruned-1", seed=8)
    pub = _publisher(f"ws://127.0.0.1:{port}", syn).start()
    collector = start_collector(db_url, args=["--port", str(port)])
    try:
        first = syn.steps(5)
        for ev in first:
            pub.publish({k: v for k, v in ev.items() if k != "seq"})
        assert pub.wait_acked(timeout=WAIT_S)
        collector.stop()
        db = connect(db_url)
        assert retention.prune(db, max_bytes=1, grace_s=0).runs_deleted == 1
        db.dispose()
        collector = start_collector(db_url, args=["--port", str(port)])
        more = syn.steps(3)
        for ev in more:
            pub.publish({k: v for k, v in ev.items() if k != "seq"})
        assert pub.wait_acked(timeout=WAIT_S)
        pub.close(timeout=WAIT_S)
    finally:
        pub.close(timeout=1)
        collector.stop()
    db = connect(db_url, readonly=True)
    [gap] = queries.gaps(db, engine_id="eng-pruned").itertuples()
    assert (gap.first_seq_lost, gap.last_seq_lost) == (1, len(first))
    assert "no longer holds" in gap.reason
    n_steps = sum(ev["type"] == "step" for ev in more)
    assert list(queries.steps(db, engine_id="eng-pruned")["step"]) == list(range(5, 5 + n_steps))
    db.dispose()


def test_a_store_fault_that_clears_behind_queued_frames_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real publisher against the real collector: SQLite's write lock is held (another
    connection) past the busy timeout while a frame is written, a later frame waits in the
    collector's queue, and the lock goes before that frame's turn. Every seq ends up stored
    exactly once: the later frame is not stored past the failed one, and the publisher's resend
    from the durable seq fills the hole."""
    import sqlite3

    from storage import db as dbm
    from tests.storage.helpers import stored_seqs

    monkeypatch.setattr(dbm, "BUSY_TIMEOUT_MS", 1500)
    db_url = f"sqlite:///{tmp_path / 'f.db'}"
    syn = SyntheticEngine(engine_id="eng-fault", run_id="run-fault-1", seed=9)
    with collector_in_thread(db_url) as collector:
        pub = _publisher(collector.url, syn).start()
        try:
            for ev in syn.steps(5):
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            assert pub.wait_acked(timeout=WAIT_S)
            locker = sqlite3.connect(str(tmp_path / "f.db"), isolation_level=None)
            locker.execute("BEGIN EXCLUSIVE")
            try:
                for ev in syn.steps(3):  # frame N: its batch waits for the lock, then fails
                    pub.publish({k: v for k, v in ev.items() if k != "seq"})
                time.sleep(0.5)
                for ev in syn.steps(3):  # frame N+1: queued behind it
                    pub.publish({k: v for k, v in ev.items() if k != "seq"})
                wait_until(lambda: collector.store_problem() != "", "the failed batch")
            finally:
                locker.execute("ROLLBACK")  # the fault clears; frame N+1 is still queued
                locker.close()
            for ev in syn.steps(2):
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            assert pub.wait_acked(timeout=WAIT_S)
            pub.close(timeout=WAIT_S)
        finally:
            pub.close(timeout=1)
    assert stored_seqs(db_url, "eng-fault", "run-fault-1") == list(range(1, syn.seq + 1))


def test_an_event_over_the_frame_limit_becomes_a_gap_and_the_stream_goes_on(
    tmp_path: Path,
) -> None:
    """A client-chosen request id of several MB (the vLLM bridge passes it on) makes one event
    larger than any frame the collector takes: it is stored as a gap that says why, and every
    later event still arrives."""
    db_url = f"sqlite:///{tmp_path / 'big.db'}"
    syn = SyntheticEngine(engine_id="eng-big", run_id="run-big-1", seed=8)
    before, after = syn.steps(3), syn.steps(3)
    with collector_in_thread(db_url) as collector:
        pub = _publisher(collector.url, syn).start()
        try:
            for ev in before:
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            big = {"type": "request", "kind": "arrived", "request_id": "x" * (5 << 20),
                   "time_ns": 1}  # fmt: skip
            pub.publish(big)
            for ev in after:
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            assert pub.wait_acked(timeout=8), pub.stats()
            assert pub.stats().acked_seq == len(before) + 1 + len(after)
        finally:
            pub.close(timeout=2)
    db = connect(db_url, readonly=True)
    [gap] = queries.gaps(db, engine_id="eng-big").itertuples()
    assert gap.seq == len(before) + 1 and gap.num_events_lost == 1
    assert "bytes" in gap.reason and "limit" in gap.reason
    n_steps = sum(ev["type"] == "step" for ev in before + after)
    assert len(queries.steps(db, engine_id="eng-big")) == n_steps
