"""Retention (storage.retention, ``chunkscope prune``, the collector's keeper): what is deleted
leaves every reader consistent and a live run's seq rules intact, on both backends."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import func, select

from storage import db as dbm
from storage import queries, retention, schema
from storage.cli import main as storage_main
from storage.packing import unpack_chunks
from storage.store import Disconnect, Events, EventsResult, Hello, Store
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import stored_seqs, wait_until

HOUR_NS = 3600 * 10**9
DAY_S = 86400.0


def _run(
    store: Store, eng: SyntheticEngine, n_steps: int, *, end: bool
) -> tuple[int, list[dict[str, Any]]]:
    [info] = store.apply([Hello(eng.hello())])
    events = eng.steps(n_steps)
    if end:
        events.append(eng.goodbye())
    for i in range(0, len(events), 500):
        [res] = store.apply([Events(info.run_key, events[i : i + 500])])
        assert isinstance(res, EventsResult) and not res.bad
    if end:
        store.apply([Disconnect(info.run_key)])
    return info.run_key, events


def _engine(name: str, days_ago: float, step_ns: int, seed: int = 0) -> SyntheticEngine:
    return SyntheticEngine(
        engine_id=name,
        run_id=f"{name}-run",
        seed=seed,
        step_ns=step_ns,
        wall_ns=time.time_ns() - int(days_ago * DAY_S * 1e9),
        concurrency=8,
        output_tokens=(2, 6),
    )


def _count(db: Any, table: Any, run_key: int) -> int:
    with db.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).select_from(table).where(table.c.run_key == run_key)
            ).scalar()
        )


def _requests_named_by_steps_exist(db: Any, run_key: int) -> None:
    """Every request a stored step names has its requests row (the dashboard joins them)."""
    s, r = schema.steps, schema.requests
    with db.connect() as conn:
        blobs = [row[0] for row in conn.execute(select(s.c.chunks).where(s.c.run_key == run_key))]
        known = {row[0] for row in conn.execute(select(r.c.req_no).where(r.c.run_key == run_key))}
    named = {int(x) for x in unpack_chunks(blobs)["req"]} if blobs else set()
    assert named <= known, sorted(named - known)[:10]


def test_sizes_and_ages_parse_with_reasons() -> None:
    assert retention.parse_bytes("10G") == 10 * 1024**3
    assert retention.parse_bytes("512MiB") == 512 * 1024**2
    assert retention.parse_bytes("1.5GB") == int(1.5 * 1024**3)
    assert retention.parse_bytes("4096") == 4096
    assert retention.parse_age("7d") == 7 * DAY_S and retention.parse_age("90m") == 5400
    for bad in ("", "lots", "-1G", "0", "nan", "inf"):
        with pytest.raises(ValueError):
            retention.parse_bytes(bad)
        with pytest.raises(ValueError):
            retention.parse_age(bad)


def test_prune_by_age_deletes_ended_runs_and_old_steps_of_a_live_one(db_url: str) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    old_key, _ = _run(store, _engine("old", 10, HOUR_NS // 100), 200, end=True)
    # live: started 3 days ago, one step an hour, still connected
    live = _engine("live", 3, HOUR_NS, seed=1)
    live_key, live_events = _run(store, live, 60, end=False)
    recent_key, _ = _run(store, _engine("recent", 0.5, HOUR_NS // 100, seed=2), 50, end=True)
    last_seq = live_events[-1]["seq"]
    steps_before = _count(db, schema.steps, live_key)

    now = time.time()
    result = retention.prune(db, older_than_s=DAY_S, now=now)
    assert result.complete and result.runs_deleted == 1
    with db.connect() as conn:
        ids = {r[0] for r in conn.execute(select(schema.runs.c.id))}
        engines = {r[0] for r in conn.execute(select(schema.engines.c.engine_id))}
    assert ids == {live_key, recent_key} and "old" not in engines
    for table in (schema.steps, schema.requests, schema.request_events):
        assert _count(db, table, old_key) == 0
    # the live run: steps that started before the cutoff are gone, the rest kept
    kept = _count(db, schema.steps, live_key)
    young = [
        e for e in live_events if e["type"] == "step" and live.wall(e["start_ns"]) >= now - DAY_S
    ]
    assert kept == len(young) and 0 < kept < steps_before
    _requests_named_by_steps_exist(db, live_key)
    assert _count(db, schema.steps, recent_key) == 50  # newer than the cutoff: untouched
    # the dashboard's reads still work on what is left
    shown = queries.steps(db, engine_id="live")
    assert len(shown) == kept
    chunks = queries.step_chunks(
        db, engine_id="live", step_from=0, step_to=int(shown["step"].max())
    )
    assert not chunks.empty and chunks["request_id"].notna().all()
    # ingest's seq rules hold: the run's last seq is unchanged, a resent old event is a
    # duplicate (not stored again), and the next events are stored
    store.close()
    store = Store(db)
    more = live.steps(3)
    [res] = store.apply([Events(live_key, live_events[:5] + more)])
    assert isinstance(res, EventsResult)
    assert res.duplicates == 5 and res.last_seq == more[-1]["seq"] > last_seq
    assert _count(db, schema.steps, live_key) == kept + 3
    store.close()
    db.dispose()


def test_prune_by_size_takes_the_oldest_ended_runs_first_and_keeps_a_live_run(
    db_url: str,
) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    keys = [
        _run(store, _engine(f"e{i}", 5 - i, HOUR_NS // 1000, seed=i), 400, end=True)[0]
        for i in range(4)
    ]
    live = _engine("live", 0.1, HOUR_NS // 1000, seed=9)
    live_key, live_events = _run(store, live, 400, end=False)
    store.close()
    size = retention.store_size(db).used_bytes
    assert size > 0
    result = retention.prune(db, max_bytes=size // 2)
    assert result.complete and 2 <= result.runs_deleted <= 4
    with db.connect() as conn:
        left = [r[0] for r in conn.execute(select(schema.runs.c.id).order_by(schema.runs.c.id))]
    assert live_key in left
    assert left[:-1] == keys[len(keys) - len(left) + 1 :]  # the oldest went first
    if db.dialect.name == "sqlite":  # pages in use: exact
        assert result.size_after <= size // 2
    # only the live run left and still too big: its oldest steps go, its row and seq stay
    result = retention.prune(db, max_bytes=max(1, retention.store_size(db).used_bytes // 3))
    assert live_key in [r.id for r in retention._runs(db)]
    assert 0 < _count(db, schema.steps, live_key) < 400
    _requests_named_by_steps_exist(db, live_key)
    with db.connect() as conn:
        seq = conn.execute(
            select(schema.runs.c.last_seq).where(schema.runs.c.id == live_key)
        ).scalar()
    assert seq == live_events[-1]["seq"]
    db.dispose()


def test_a_pass_is_bounded_and_the_next_one_goes_on(sqlite_url: str) -> None:
    db = dbm.connect(sqlite_url)
    dbm.migrate(db)
    store = Store(db)
    key, _ = _run(store, _engine("old", 10, HOUR_NS // 1000), 300, end=True)
    store.close()
    result = retention.prune(db, older_than_s=DAY_S, max_rows=100, batch_rows=40)
    assert not result.complete and 0 < result.rows_deleted <= 100
    assert [r.id for r in retention._runs(db)] == [key]  # not gone yet: the budget ran out
    for _ in range(50):
        result = retention.prune(db, older_than_s=DAY_S, max_rows=100, batch_rows=40)
        if result.complete:
            break
    assert result.complete and retention._runs(db) == []
    db.dispose()


def test_prune_cli(tmp_path: Any, capsys: Any) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    db = dbm.connect(url)
    dbm.migrate(db)
    store = Store(db)
    _run(store, _engine("old", 10, HOUR_NS // 1000), 200, end=True)
    _run(store, _engine("new", 0.1, HOUR_NS // 1000, seed=3), 200, end=True)
    store.close()
    db.dispose()
    for usage_error in (["--db", url], ["--db", url, "--older-than", "soon"]):
        with pytest.raises(SystemExit) as info:  # nothing to do; not an age
            storage_main(["prune", *usage_error])
        assert info.value.code == 2
    capsys.readouterr()
    assert storage_main(["prune", "--db", url, "--older-than", "7d", "--vacuum"]) == 0
    out = capsys.readouterr().out
    assert "deleted 1 run(s)" in out and "vacuumed" in out
    from chunkscope.cli import main as chunkscope_main

    assert chunkscope_main(["prune", "--db", url, "--max-size", "1K"]) == 0
    assert "deleted 1 run(s)" in capsys.readouterr().out
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    assert storage_main(["prune", "--db", missing, "--dry-run"]) == 2


def test_the_collector_keeps_its_store_within_limits_while_ingesting(
    collector_factory: Any, db_url: str
) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    _run(store, _engine("old", 10, HOUR_NS // 1000), 200, end=True)
    store.close()
    col = collector_factory(db_url, prune_older_than=DAY_S, retention_interval=0.2)
    eng = SyntheticEngine(engine_id="fresh", run_id="fresh-run", seed=5)
    client = FakeEngineClient(col.url, eng)
    client.connect()
    events = eng.steps(40)
    client.send_events(events)
    client.wait_ack(events[-1]["seq"])
    wait_until(lambda: [r for r in retention._runs(db) if r.engine_id == "old"] == [], 10)
    client.send_events(more := eng.steps(10))
    client.wait_ack(more[-1]["seq"])
    client.close()
    seqs = stored_seqs(db_url, "fresh", "fresh-run")
    assert seqs == sorted(set(seqs)) and seqs[-1] == more[-1]["seq"]  # once each, none lost
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{col.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    sizes = [ln for ln in text.splitlines() if ln.startswith("collector_store_size_bytes ")]
    assert sizes and float(sizes[0].split()[1]) > 0
    assert "collector_pruned_runs_total 1.0" in text
    db.dispose()


def test_a_run_pruned_under_the_writer_is_never_written_in_half(db_url: str) -> None:
    """The writer keeps a run in memory; a prune deletes it meanwhile (SQLite reads outside
    the write transaction, so nothing serializes the two): the writer's next batch for that
    run is rolled back, not stored as rows of a run that no longer exists."""
    from storage.store import RunGone

    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    eng = _engine("old", 10, HOUR_NS // 1000)
    key, _ = _run(store, eng, 20, end=True)  # disconnected: read back at its next batch
    assert retention.prune(db, older_than_s=DAY_S).runs_deleted == 1
    with pytest.raises(RunGone):
        store.apply([Events(key, eng.steps(2))])
    assert _count(db, schema.steps, key) == 0  # no orphan rows
    [info] = store.apply([Hello(eng.hello())])  # the engine's hello: the run starts again
    assert info.last_seq == 0 and not info.refused
    store.close()
    db.dispose()


def test_a_run_within_its_reconnection_grace_is_never_deleted_whole(db_url: str) -> None:
    """A run whose engine left without a goodbye may come back (the engine retries with
    backoff): a size prune keeps it whole for the grace period, and deletes a run that ended
    with a goodbye instead."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    gone_key, _ = _run(store, _engine("ended", 10, HOUR_NS // 1000, seed=1), 30, end=True)
    away_key, _ = _run(store, _engine("away", 9, HOUR_NS // 1000, seed=2), 30, end=False)
    store.apply([Disconnect(away_key)])  # no goodbye: in reconnect backoff
    store.close()
    result = retention.prune(db, max_bytes=1)
    runs = {r.id for r in retention._runs(db)}
    assert gone_key not in runs and away_key in runs and result.runs_deleted == 1
    later = time.time() + retention.RECONNECT_GRACE_S + 1
    assert retention.prune(db, max_bytes=1, now=later).runs_deleted == 1
    assert away_key not in {r.id for r in retention._runs(db)}
    db.dispose()


def test_runs_live_when_the_collector_stopped_get_the_grace_from_its_restart(db_url: str) -> None:
    """The collector restarts: its store marks every run that was connected as ended without
    goodbye, and the keeper's first pass runs at once. A run last seen long ago (the collector
    was down) is still kept whole while its engine reconnects."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    key, _ = _run(store, _engine("live", 9, HOUR_NS // 1000, seed=3), 30, end=False)
    store.close()
    with db.begin() as conn:  # seen last a day ago, still marked connected: the collector died
        conn.execute(schema.runs.update().values(last_seen=time.time() - DAY_S))
    keeper = retention.Keeper(db, max_bytes=1)
    keeper.note_restart()  # the collector does this before its store's startup
    restarted = Store(db)
    assert restarted.startup() == 1
    restarted.close()
    result = keeper.run_once()
    assert result is not None and result.runs_deleted == 0
    assert key in {r.id for r in retention._runs(db)}
    # without the restart's grace (a prune by hand), the run is old enough to go
    assert retention.prune(db, max_bytes=1).runs_deleted == 1
    db.dispose()
