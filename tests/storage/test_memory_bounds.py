"""The collector's memory is bounded in bytes: what waits for the writer never passes
``max_pending_bytes``; a frame past it is refused (close 1013, not acknowledged) and its engine
resends it later, so every seq is still stored exactly once."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from engine.telemetry import Publisher
from storage import queries, schema
from storage import store as store_module
from storage.collector import CollectorConfig
from storage.db import connect, migrate
from storage.store import Disconnect, Events, EventsResult, Hello, Store
from testkit.collector import collector_in_thread
from testkit.engines import SyntheticEngine
from tests.storage.helpers import stored_seqs, wait_until

FRAME = 64 * 1024
BOUND = 4 * FRAME


def _refusals(collector: Any, reason: str) -> float:
    value = collector.metrics.registry.get_sample_value(
        "collector_refusals_total", {"reason": reason}
    )
    return value or 0.0


def test_frames_past_the_byte_bound_wait_in_the_engine_and_are_stored_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The writer is held (a store that has stopped answering) while an engine sends frames of
    large events: what waits for it stays under the bound, the frames past it are refused
    without an ack, and once the writer goes on the engine resends them: every seq stored once,
    no gap."""
    gate = threading.Event()
    gate.set()
    apply = Store.apply

    def held(self: Store, ops: list[Any]) -> list[Any]:
        if any(isinstance(op, Events) for op in ops):
            gate.wait(60)
        return apply(self, ops)

    monkeypatch.setattr(Store, "apply", held)
    caplog.set_level(logging.WARNING, logger="engine.telemetry.publisher")
    db_url = f"sqlite:///{tmp_path / 'bound.db'}"
    syn = SyntheticEngine(engine_id="eng-bytes", run_id="run-bytes-1", seed=21)
    fields = {k: v for k, v in syn.hello().items() if k not in ("engine_id", "run_id")}
    with collector_in_thread(db_url, max_frame_bytes=FRAME, max_pending_bytes=BOUND) as collector:
        pub = Publisher(
            collector.url, engine_id=syn.engine_id, run_id=syn.run_id, hello=lambda: fields,
            linger_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.3, max_frame_bytes=FRAME,
        ).start()  # fmt: skip
        try:
            for ev in syn.steps(3):
                pub.publish({k: v for k, v in ev.items() if k != "seq"})
            assert pub.wait_acked(timeout=10)
            gate.clear()  # the writer stops at its next batch of events
            pad = "p" * 2000  # an unknown field: counted in the frame, ignored by the store
            for ev in syn.steps(60):
                pub.publish({**{k: v for k, v in ev.items() if k != "seq"}, "pad": pad})
            wait_until(lambda: _refusals(collector, "busy") >= 1, 20, "a refused frame")
            waiting = collector.metrics.registry.get_sample_value("collector_pending_bytes")
            assert 0 < waiting <= BOUND and collector._pending_bytes == waiting
            assert pub.stats().acked_seq < syn.seq  # the refused frames are not acknowledged
            wait_until(lambda: "collector is busy (close 1013" in caplog.text, 10, "the reason")
            gate.set()  # the store answers again
            assert pub.wait_acked(timeout=30), pub.stats()
            assert pub.stats().acked_seq == syn.seq
            pub.close(timeout=10)
        finally:
            gate.set()
            pub.close(timeout=1)
        assert collector._pending_bytes == 0 and not collector._op_bytes
    assert stored_seqs(db_url, "eng-bytes", "run-bytes-1") == list(range(1, syn.seq + 1))
    db = connect(db_url, readonly=True)
    assert queries.gaps(db, engine_id="eng-bytes").empty
    db.dispose()


def test_the_byte_bound_holds_a_whole_frame() -> None:
    with pytest.raises(ValueError, match="max_pending_bytes"):
        CollectorConfig(db_url="sqlite://", max_frame_bytes=FRAME, max_pending_bytes=FRAME - 1)


# ---- runs per engine id ---------------------------------------------------------------------


def _hello_refusal(url: str, hello: dict[str, Any]) -> tuple[int | None, str]:
    """Say ``hello`` on a fresh connection: (close code, reason), or (None, "") when acked."""
    with ws_connect(url + "/ingest", open_timeout=5, proxy=None) as ws:
        ws.send(json.dumps(hello))
        try:
            reply = json.loads(ws.recv(timeout=5))
        except ConnectionClosed:
            return ws.close_code, ws.close_reason or ""
        assert reply["type"] == "ack", reply
        return None, ""


def _runs_of(db_url: str, engine_id: str) -> list[str]:
    db = connect(db_url, readonly=True)
    try:
        with db.connect() as c:
            r = schema.runs
            rows = c.execute(select(r.c.run_id).where(r.c.engine_id == engine_id)).all()
        return sorted(row.run_id for row in rows)
    finally:
        db.dispose()


def test_an_engine_id_starts_a_bounded_number_of_runs(
    tmp_path: Path, collector_factory: Any
) -> None:
    """Each hello with a new run id would make a run row: past the limit within the window it
    is refused (close 4429, saying why) and stores nothing; the id's known runs reconnect,
    other ids are not affected, a restarted collector counts the same, and runs that started
    before the window no longer count."""
    db_url = f"sqlite:///{tmp_path / 'runs.db'}"
    collector = collector_factory(db_url, max_runs_per_engine=3)
    engines = [SyntheticEngine(engine_id="eng-many", run_id=f"run-{i}", seed=i) for i in range(5)]
    for syn in engines[:3]:
        assert _hello_refusal(collector.url, syn.hello()) == (None, "")
    code, reason = _hello_refusal(collector.url, engines[3].hello())
    assert code == 4429 and "3 runs in 3600 s" in reason and "--max-runs-per-engine" in reason
    assert _runs_of(db_url, "eng-many") == ["run-0", "run-1", "run-2"]
    assert _hello_refusal(collector.url, engines[1].hello()) == (None, "")  # a known run
    other = SyntheticEngine(engine_id="eng-other", run_id="run-0", seed=9)
    assert _hello_refusal(collector.url, other.hello()) == (None, "")
    collector_factory.stop_last()
    collector = collector_factory(db_url, max_runs_per_engine=3)
    assert _hello_refusal(collector.url, engines[3].hello())[0] == 4429  # counted in the store
    db = connect(db_url)
    with db.begin() as c:  # the first two runs started two hours ago
        r = schema.runs
        c.execute(
            update(r)
            .where(r.c.engine_id == "eng-many", r.c.run_id.in_(["run-0", "run-1"]))
            .values(started=r.c.started - 7200)
        )
    db.dispose()
    assert _hello_refusal(collector.url, engines[3].hello()) == (None, "")
    assert _hello_refusal(collector.url, engines[4].hello()) == (None, "")
    assert _hello_refusal(collector.url, engines[0].hello()) == (None, "")  # still known
    assert _runs_of(db_url, "eng-many") == [f"run-{i}" for i in range(5)]


# ---- what the writer keeps in memory --------------------------------------------------------


def _req(seq: int, rid: str, kind: str, t: int) -> dict[str, Any]:
    return {"type": "request", "seq": seq, "request_id": rid, "kind": kind, "time_ns": t}


def test_the_writer_forgets_disconnected_runs_and_idle_unfinished_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose connection is gone leaves the writer's memory (read back when it returns);
    a run's unfinished requests held in memory stay bounded (the least recently active are read
    back from the database when an event names them), and nothing is stored twice."""
    monkeypatch.setattr(store_module, "MAX_REQUESTS_IN_MEMORY", 8)
    db_url = f"sqlite:///{tmp_path / 'mem.db'}"
    db = connect(db_url)
    migrate(db)
    store = Store(db)
    store.startup()
    [info] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    events = [_req(i + 1, f"q{i}", "arrived", 100 + i) for i in range(30)]
    [res] = store.apply([Events(info.run_key, events)])
    assert isinstance(res, EventsResult) and res.stored == 30
    held = store._runs[info.run_key].requests
    assert len(held) <= 8 and "q29" in held and "q0" not in held  # the newest are kept
    late = [_req(31, "q0", "finished", 5000), _req(32, "q29", "finished", 5001)]
    [res] = store.apply([Events(info.run_key, late)])
    assert isinstance(res, EventsResult) and res.stored == 2 and not res.bad
    store.apply([Disconnect(info.run_key)])
    assert info.run_key not in store._runs
    [again] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    assert again.run_key == info.run_key and again.last_seq == 32
    assert len(store._runs[info.run_key].requests) <= 8  # read back: the newest unfinished
    [res] = store.apply([Events(info.run_key, [_req(33, "q5", "finished", 6000)])])
    assert isinstance(res, EventsResult) and res.stored == 1 and not res.bad
    store.close()
    with db.connect() as c:
        q = schema.requests
        rows = c.execute(select(q.c.request_id, q.c.finished_ns, q.c.req_no)).all()
    db.dispose()
    assert len(rows) == 30 and len({r.req_no for r in rows}) == 30
    done = {r.request_id: r.finished_ns for r in rows if r.finished_ns is not None}
    assert done == {"q0": 5000, "q29": 5001, "q5": 6000}
