"""Several collectors on one PostgreSQL store: a control sent to any collector reaches the
engine wherever it is connected, every collector lists the whole fleet with the collector each
engine is connected to, and ``GET /sd`` lists the fleet for Prometheus."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from storage import fleet, queries
from storage.collector_fleet import metrics_url, sd_groups
from storage.control import list_engines, send_control
from storage.db import connect
from testkit.engines import FakeEngineClient, SyntheticEngine
from testkit.postgres import PostgresServer

WAIT_S = 20.0


def _wait_for(cond: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _listed(url: str, engine_id: str) -> dict[str, Any] | None:
    rows = {r["engine_id"]: r for r in list_engines(url)}
    row = rows.get(engine_id)
    return row if row is not None and row.get("connected") else None


def test_a_control_sent_to_any_collector_reaches_the_engine(
    pg_server: PostgresServer, collector_factory: Callable[..., Any]
) -> None:
    db_url = pg_server.create_database()
    a = collector_factory(db_url)
    b = collector_factory(db_url)
    syn = SyntheticEngine(engine_id="eng-a", run_id="run-a-1", seed=1)
    hello = syn.hello()
    engine = FakeEngineClient(a.url, syn)
    engine.engine.hello = lambda token=None: {  # type: ignore[method-assign]
        **hello,
        "metrics_url": "http://127.0.0.1:9/metrics",
    }
    engine.connect()
    try:
        engine.send_events(syn.steps(20))
        engine.wait_ack(syn.seq)
        # B lists the engine as connected through A, once A's heartbeat wrote it
        row = _wait_for(lambda: _listed(b.url, "eng-a"), "collector B to list eng-a")
        assert row["collector"] == a.url and row["model"] == "synthetic"
        assert _listed(a.url, "eng-a")["collector"] == a.url  # type: ignore[index]
        ack = send_control(
            b.url, "eng-a", {"token_budget": 128}, source="autopilot", reason="fleet"
        )
        assert ack["ok"] is True, ack
        assert ack["new"] == {"token_budget": 128} and ack["collector"] == a.url
        assert [c["set"] for c in engine.controls] == [{"token_budget": 128}]
        # the engine's own control event, stored through A, carries B's client's declaration
        engine.send_events(syn.steps(1))
        engine.wait_ack(syn.seq)
        # a refusal by the engine comes back the same way
        refused = send_control(b.url, "eng-a", {"token_budget": 10**9})
        assert refused["ok"] is False and "token_budget" in refused["error"]
        # an engine nobody holds is unknown everywhere
        unknown = send_control(b.url, "eng-nobody", {"token_budget": 64})
        assert unknown["ok"] is False and "unknown engine" in unknown["error"]
        # Prometheus service discovery on B: the engine (through A) and both collectors
        with urllib.request.urlopen(f"http://127.0.0.1:{b.port}/sd", timeout=10) as resp:
            groups = json.loads(resp.read())
        engines = [g for g in groups if g["labels"]["chunkscope_role"] == "engine"]
        assert engines == [
            {
                "targets": ["127.0.0.1:9"],
                "labels": {
                    "__scheme__": "http",
                    "__metrics_path__": "/metrics",
                    "chunkscope_role": "engine",
                    "engine_id": "eng-a",
                    "collector": a.url,
                    "model": "synthetic",
                },
            }
        ]
        collectors = sorted(
            g["targets"][0] for g in groups if g["labels"]["chunkscope_role"] == "collector"
        )
        assert collectors == sorted(f"127.0.0.1:{c.port}" for c in (a, b))
    finally:
        engine.close()
    db = connect(db_url, readonly=True)
    controls = queries.controls(db, engine_id="eng-a")
    accepted = controls[controls["accepted"]]
    assert list(accepted["new_value"]) == [128]
    assert set(accepted["source"]) == {"autopilot"}
    assert len(fleet.fleet_engines(db)) == 1


def test_metrics_url_takes_http_urls_only() -> None:
    assert metrics_url("http://10.0.0.5:8000/metrics") == "http://10.0.0.5:8000/metrics"
    for bad in ("ws://h:1/metrics", "http://h:x/metrics", "http:///metrics", 7, "x" * 600):
        assert metrics_url(bad) is None


def test_sd_groups_skip_engines_without_an_address_or_connection() -> None:
    rows = [
        {"engine_id": "e1", "connected": True, "metrics_url": "https://h:1/m", "collector": "c"},
        {"engine_id": "e2", "connected": False, "metrics_url": "http://h:2/metrics"},
        {"engine_id": "e3", "connected": True, "metrics_url": None},
    ]
    groups = sd_groups(rows, [{"url": "wss://c:9"}])
    assert [g["targets"] for g in groups] == [["h:1"], ["c:9"]]
    assert groups[0]["labels"]["__metrics_path__"] == "/m"
    assert groups[1]["labels"]["__scheme__"] == "https"


def test_engines_of_a_gone_collector_are_listed_not_connected(
    pg_server: PostgresServer, collector_factory: Callable[..., Any]
) -> None:
    db_url = pg_server.create_database()
    a = collector_factory(db_url)
    syn = SyntheticEngine(engine_id="eng-gone", run_id="run-g-1", seed=2)
    engine = FakeEngineClient(a.url, syn)
    engine.connect()
    engine.send_events(syn.steps(5))
    engine.wait_ack(syn.seq)
    db = connect(db_url, readonly=True)
    _wait_for(lambda: fleet.fleet_engines(db), "the fleet row")
    later = time.time() + fleet.STALE_AFTER_S + 5  # as if A's heartbeat stopped then
    (row,) = fleet.fleet_engines(db, now=later)
    assert row["connected"] is False and row["collector"] == a.url
    engine.close()


def test_two_writers_of_one_run_store_each_seq_once(pg_server: PostgresServer) -> None:
    """Collector A still holds a run in memory when the engine moved to B and back: A's next
    batch finds the durable seq B moved, rereads the run, and skips what B stored."""
    from sqlalchemy import func, select

    from storage import db as dbm
    from storage import schema
    from storage.store import Events, Hello, Store

    db_url = pg_server.create_database()
    db = dbm.connect(db_url)
    dbm.migrate(db)
    a, b = Store(db), Store(db)
    assert a.shared and b.shared
    syn = SyntheticEngine(engine_id="eng-2w", run_id="run-2w", seed=3)
    events = syn.steps(30)
    (info,) = a.apply([Hello(syn.hello())])
    (done,) = a.apply([Events(info.run_key, events[:10])])
    assert done.last_seq == 10
    (info_b,) = b.apply([Hello(syn.hello())])
    assert info_b.last_seq == 10
    (done,) = b.apply([Events(info.run_key, events[10:20])])
    assert done.last_seq == 20
    # A never saw B's hello: its memory says 10; the frames it still had queued resend 11-25
    (done,) = a.apply([Events(info.run_key, events[10:25])])
    assert (done.last_seq, done.duplicates, done.stored) == (25, 10, 5)
    (done,) = b.apply([Events(info.run_key, events[20:])])
    assert (done.last_seq, done.duplicates) == (len(events), 5)
    with db.connect() as conn:
        stored = sum(
            conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (schema.steps, schema.request_events)
        )
    assert stored == len(events)
    a.close()
    b.close()
    db.dispose()


def test_a_batch_of_several_runs_with_one_gone_is_rolled_back(tmp_path: Any) -> None:
    """The runs of a batch are updated in one statement; a run whose row is gone (deleted
    under the writer) still rolls the whole batch back."""
    from sqlalchemy import delete, func, select

    from storage import db as dbm
    from storage import schema
    from storage.store import Events, Hello, RunGone, Store

    db = dbm.connect(f"sqlite:///{tmp_path / 's.db'}")
    dbm.migrate(db)
    store = Store(db)
    engines = [SyntheticEngine(engine_id=f"e{i}", run_id=f"r{i}", seed=i) for i in range(3)]
    keys = [info.run_key for info in store.apply([Hello(e.hello()) for e in engines])]
    results = store.apply([Events(k, e.steps(3)) for k, e in zip(keys, engines, strict=True)])
    assert [r.last_seq for r in results] == [e.seq for e in engines]
    with db.begin() as conn:
        conn.execute(delete(schema.runs).where(schema.runs.c.id == keys[1]))
        before = conn.execute(select(func.count()).select_from(schema.steps)).scalar_one()
    with pytest.raises(RunGone):
        store.apply([Events(k, e.steps(2)) for k, e in zip(keys, engines, strict=True)])
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(schema.steps)).scalar_one() == before
    store.close()
    db.dispose()


@pytest.mark.parametrize("url", ["http://a:1", "ws://a", "ws://:1", "ws://a:port", "a:1"])
def test_a_malformed_advertise_url_is_refused(url: str) -> None:
    from storage.collector_config import CollectorConfig

    with pytest.raises(ValueError, match="advertise_url"):
        CollectorConfig(db_url="sqlite://", advertise_url=url)
    assert CollectorConfig(db_url="sqlite://", advertise_url="wss://h:1").advertise_url
