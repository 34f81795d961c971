"""An engine that reconnects while the store is slow: the run stays marked connected while its
newest connection streams, whatever order the older connection's hello and close come in."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

import pytest
from websockets.sync.client import connect

from storage import db as dbm
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import run_row, wait_until


def test_a_late_hello_result_leaves_the_live_run_connected(
    collector_factory: Any, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first hello waits for the store's write lock; the engine gives up on it and says
    hello again on a new connection (queued behind the first). The first hello's result then
    finds its socket gone, and its close must not mark the run disconnected after the second
    hello marked it connected."""
    monkeypatch.setattr(dbm, "BUSY_TIMEOUT_MS", 10_000)
    col = collector_factory(sqlite_url)
    eng = SyntheticEngine(engine_id="e", run_id="r", seed=2)
    warm = FakeEngineClient(col.url, eng)  # the run exists, the store is warm
    warm.connect()
    warm.close()
    wait_until(lambda: not run_row(sqlite_url, "e", "r")["connected"], 10, "the first close")
    locker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        with connect(col.url + "/ingest", open_timeout=5, proxy=None) as first:
            first.send(json.dumps(eng.hello()))
            time.sleep(0.5)  # the writer holds this hello, waiting for the lock
        second = FakeEngineClient(col.url, eng)
        waiting = _connect_later(second)
        time.sleep(0.5)  # the second hello is queued behind the first
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    waiting.join(20)
    assert second.acked == 0 and second.close_code is None
    events = eng.steps(2)
    second.send_events(events)
    assert second.wait_ack(events[-1]["seq"]) == events[-1]["seq"]
    time.sleep(0.5)  # anything the first connection left behind is written by now
    assert run_row(sqlite_url, "e", "r")["connected"], "the live run is marked disconnected"
    second.close()


def _connect_later(client: FakeEngineClient) -> Any:
    import threading

    t = threading.Thread(target=client.connect, kwargs={"timeout": 20}, daemon=True)
    t.start()
    return t
