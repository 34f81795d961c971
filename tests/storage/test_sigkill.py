"""SIGKILL the collector in the middle of a run, restart it on the same store, let the engine
resend what was not acknowledged: every event is stored exactly once, nothing acked is lost."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed

from storage import db as dbm
from storage import queries
from testkit.collector import start_collector
from testkit.engines import FakeEngineClient, SyntheticEngine, frames

from .helpers import run_row, stored_seqs


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_sigkill_mid_run_then_resend(
    request: pytest.FixtureRequest, tmp_path: Any, backend: str
) -> None:
    if backend == "sqlite":
        db_url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        db_url = request.getfixturevalue("pg_server").create_database()
    eng = SyntheticEngine(engine_id="engine-kill", run_id="run-kill", seed=21, concurrency=32)
    events = eng.steps(600)
    all_frames = frames(eng, events, per_frame=40)
    total = eng.seq

    first = start_collector(db_url)
    try:
        client = FakeEngineClient(first.url, eng)
        client.connect()
        half = len(all_frames) // 2
        for frame in all_frames[:half]:
            client.send(frame)
        client.wait_ack(all_frames[half // 2]["events"][-1]["seq"], timeout=60)
        for frame in all_frames[half : half + 5]:  # more in flight when the kill lands
            client.send(frame)
        acked_before_kill = client.acked
        first.kill()
        client.wait_closed(timeout=30)
        with pytest.raises(ConnectionClosed):
            client.send(all_frames[half + 5])
    finally:
        first.stop()

    # after the crash, the run waits for its engine: not connected, ended without goodbye
    row = run_row(db_url, "engine-kill", "run-kill")
    assert row["last_seq"] >= acked_before_kill  # nothing acknowledged is lost

    second = start_collector(db_url)
    try:
        row = run_row(db_url, "engine-kill", "run-kill")
        assert row["ended_without_goodbye"] and not row["connected"]
        client = FakeEngineClient(second.url, eng)
        durable = client.connect()
        assert acked_before_kill <= durable < total
        # the publisher resends everything after the durable seq
        rest = [e for e in events if e["seq"] > durable]
        client.send_events(rest, per_frame=40)
        client.send_events([eng.goodbye()])
        assert client.wait_ack(eng.seq, timeout=60) == eng.seq
        client.close()
        assert client.errors == []
    finally:
        assert second.stop() == 0

    bye = eng.seq
    seqs = stored_seqs(db_url, "engine-kill", "run-kill")
    assert seqs == list(range(1, bye))  # each once, no gap (the goodbye is kept on the run)
    row = run_row(db_url, "engine-kill", "run-kill")
    assert row["last_seq"] == bye and not row["ended_without_goodbye"] and row["ended"]
    db = dbm.connect(db_url, readonly=True)
    try:
        st = queries.steps(db, engine_id="engine-kill")
        assert list(st.step) == list(range(600))  # equal to the engine's own step counter
        assert row["num_steps"] == eng.step == 600
        for rid, times in eng.truth.items():
            assert list(queries.token_times(db, request_id=rid).time_ns) == times, rid
    finally:
        db.dispose()
