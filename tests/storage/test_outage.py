"""A store that stops answering (a hung database: every statement waits) over real sockets:
``/healthz`` says so within seconds, and a hello waiting for the store is answered with a close
instead of waiting forever; once the store answers again, nothing is left marked connected."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from typing import Any

from storage.store import Events, Hello
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import hello_close_code, run_row, wait_until


def _healthz(collector: Any) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{collector.port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _hang(collector: Any, kind: type) -> tuple[threading.Event, Any]:
    """Make the store hang on every batch holding a ``kind`` op until the event is set."""
    store = collector._writer.store
    original = store.apply
    release = threading.Event()

    def hanging(ops: list[Any]) -> list[Any]:
        if any(isinstance(op, kind) for op in ops):
            release.wait(30)
        return original(ops)

    store.apply = hanging
    return release, original


def test_a_hung_store_shows_on_healthz_within_5_s(collector_factory: Any, sqlite_url: str) -> None:
    collector = collector_factory(sqlite_url)
    eng = SyntheticEngine(engine_id="eng", run_id="run-a", seed=3)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    assert _healthz(collector) == (200, "ok\n")
    release, original = _hang(collector, Events)
    try:
        client.send_events(eng.steps(2))
        t0 = time.monotonic()
        status, body = wait_until(
            lambda: (h := _healthz(collector))[0] != 200 and h, timeout=8, what="/healthz 503"
        )
        assert time.monotonic() - t0 <= 5.0
        assert status == 503 and "store" in body
    finally:
        release.set()
    assert client.wait_ack(eng.seq) == eng.seq  # nothing lost: the batch commits late
    wait_until(lambda: _healthz(collector) == (200, "ok\n"), timeout=5, what="/healthz 200")
    collector._writer.store.apply = original
    client.close()


def test_a_hello_waiting_on_a_hung_store_is_closed_and_leaves_no_run_connected(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url, hello_answer_timeout=1.0)
    eng = SyntheticEngine(engine_id="eng", run_id="run-a", seed=3)
    release, original = _hang(collector, Hello)
    try:
        t0 = time.monotonic()
        assert hello_close_code(collector.url, eng.hello()) == 1011
        assert time.monotonic() - t0 < 4.0
    finally:
        release.set()
    # the hello the store answers late registers the run: it must not stay marked connected
    wait_until(lambda: run_row(sqlite_url, "eng", "run-a"), what="the late hello stored")
    wait_until(
        lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="run disconnected"
    )
    collector._writer.store.apply = original
    client = FakeEngineClient(collector.url, eng)
    assert client.connect() == 0  # the engine comes back as usual
    client.send_events(eng.steps(1))
    assert client.wait_ack(eng.seq) == eng.seq
    assert run_row(sqlite_url, "eng", "run-a")["connected"]
    client.close()
