"""The attacks of issue 18 over real sockets (loopback, port 0, bounded): nobody poses as a live
run, takes an engine id's control route, learns the control token, poisons a run's seq or makes
the collector store a row per key. The rules themselves are unit-tested in test_ingest.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from websockets.sync.client import connect

from storage import db as dbm
from storage import ingest, queries
from storage.control import exchange, list_engines, send_control
from storage.store import Events
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import hello_close_code, run_row, stored_seqs, wait_until


def _live(collector: Any, **kw: Any) -> tuple[SyntheticEngine, FakeEngineClient]:
    kw.setdefault("engine_id", "eng")
    kw.setdefault("run_id", "run-a")
    eng = SyntheticEngine(seed=3, max_token_budget=2048, **kw)
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(eng.steps(2))
    client.wait_ack(eng.seq)
    return eng, client


def _controls(db_url: str) -> Any:
    db = dbm.connect(db_url, readonly=True)
    try:
        return queries.controls(db)
    finally:
        db.dispose()


def test_a_hello_without_the_run_secret_never_replaces_or_pollutes_a_run(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _live(collector)
    forged = eng.hello()
    for secret in ("w" * 43, None):
        hello = dict(forged)
        hello.pop("run_secret")
        if secret is not None:
            hello["run_secret"] = secret
        assert hello_close_code(collector.url, hello) == 4403
    client.send_events(eng.steps(2))  # the real connection was never replaced
    assert client.wait_ack(eng.seq) == eng.seq and client.close_code is None
    client.close()
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="disconnect")
    assert hello_close_code(collector.url, dict(forged, run_secret="w" * 43)) == 4403  # not live
    back = FakeEngineClient(collector.url, eng)
    assert back.connect() == eng.seq  # the engine itself comes back, secret in hand
    back.close()
    assert stored_seqs(sqlite_url, "eng", "run-a") == list(range(1, eng.seq + 1))
    row = run_row(sqlite_url, "eng", "run-a")
    assert eng.run_secret and eng.run_secret not in json.dumps(row, default=str)  # hash only
    assert row["secret_sha256"] == ingest.secret_hash(eng.run_secret)


def test_an_engine_without_a_secret_is_not_replaced_while_live(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _live(collector, run_secret=None)
    assert hello_close_code(collector.url, eng.hello()) == 4409
    client.send_events(eng.steps(1))
    assert client.wait_ack(eng.seq) == eng.seq
    client.close()
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="disconnect")
    assert hello_close_code(collector.url, eng.hello()) is None  # it reconnects as before


def test_a_second_run_of_an_engine_id_never_takes_the_control_route(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng_a, a = _live(collector)
    eng_b, b = _live(collector, run_id="run-b")
    [row] = list_engines(collector.url)
    assert row["run_id"] == "run-a"  # the engine list names the run that holds the route
    ack = send_control(collector.url, "eng", {"token_budget": 100}, control_id="c1")
    assert ack["ok"] is True and eng_a.token_budget == 100 and b.controls == []
    ack = exchange(
        collector.url,
        {"type": "control", "id": "c2", "engine_id": "eng", "run_id": "run-b",
         "set": {"token_budget": 64}},
        "control_ack",
        "c2",
    )  # fmt: skip
    assert ack["ok"] is True and eng_b.token_budget == 64 and eng_a.token_budget == 100
    b.close()
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-b")["connected"], what="disconnect")
    ack = send_control(collector.url, "eng", {"token_budget": 200}, control_id="c3")
    assert ack["ok"] is True and eng_a.token_budget == 200  # the route survived B leaving
    [row] = list_engines(collector.url)
    assert row["run_id"] == "run-a" and row["connected"] is True
    b = FakeEngineClient(collector.url, eng_b)
    b.connect()
    a.send_events(eng_a.steps(1) + [eng_a.goodbye()])
    assert a.wait_ack(eng_a.seq) == eng_a.seq
    a.close()  # the first run ends with a goodbye: the route passes to the live one
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="disconnect")
    ack = send_control(collector.url, "eng", {"token_budget": 32}, control_id="c4")
    assert ack["ok"] is True and eng_b.token_budget == 32
    [row] = list_engines(collector.url)
    assert row["run_id"] == "run-b" and row["connected"] is True
    b.close()


def test_a_run_whose_connection_blips_keeps_its_control_route(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng_a, a = _live(collector)
    eng_b, b = _live(collector, run_id="run-b")  # same engine id, same shared publish token
    a.close()  # no goodbye: a blip, the engine is reconnecting
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="disconnect")
    ack = send_control(collector.url, "eng", {"token_budget": 100}, control_id="c1")
    assert ack["ok"] is False and "not connected" in ack["error"]
    assert b.controls == [] and eng_b.token_budget != 100  # never acked by the other run
    [row] = list_engines(collector.url)
    assert row["run_id"] == "run-a" and row["connected"] is False
    a = FakeEngineClient(collector.url, eng_a)
    assert a.connect() == eng_a.seq  # the run comes back, its secret in hand
    ack = send_control(collector.url, "eng", {"token_budget": 200}, control_id="c2")
    assert ack["ok"] is True and eng_a.token_budget == 200 and b.controls == []
    a.close()
    b.close()


def test_the_route_passes_on_once_the_reconnection_grace_is_over(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url, route_grace=1.0)
    eng_a, a = _live(collector)
    eng_b, b = _live(collector, run_id="run-b")
    a.close()
    wait_until(lambda: not run_row(sqlite_url, "eng", "run-a")["connected"], what="disconnect")
    assert send_control(collector.url, "eng", {"token_budget": 64}, control_id="c1")["ok"] is False
    ack = wait_until(
        lambda: (r := send_control(collector.url, "eng", {"token_budget": 96}))["ok"] and r,
        timeout=5,
        what="the route to pass on",
    )
    assert eng_b.token_budget == 96 and list_engines(collector.url)[0]["run_id"] == "run-b"
    assert ack["ok"] is True
    b.close()


def test_after_a_restart_the_route_waits_for_the_run_that_held_it(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng_a, a = _live(collector)
    collector_factory.stop_last()  # a collector stops while its engine is connected
    a.close()
    collector = collector_factory(sqlite_url)
    eng_b = SyntheticEngine(seed=4, max_token_budget=2048, engine_id="eng", run_id="run-b")
    b = FakeEngineClient(collector.url, eng_b)
    b.connect()  # a second run of the id says hello first
    ack = send_control(collector.url, "eng", {"token_budget": 100}, control_id="c1")
    assert ack["ok"] is False and b.controls == []
    a = FakeEngineClient(collector.url, eng_a)
    a.connect()
    ack = send_control(collector.url, "eng", {"token_budget": 200}, control_id="c2")
    assert ack["ok"] is True and eng_a.token_budget == 200 and b.controls == []
    a.close()
    b.close()


def test_an_absurd_gap_is_refused_and_the_run_goes_on(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _live(collector)
    top = 2**63 - 1
    client.send(
        {"schema": 1, "type": "events", "engine_id": "eng", "run_id": "run-a",
         "events": [{"type": "gap", "seq": top, "first_seq_lost": eng.seq + 1,
                     "last_seq_lost": top - 1, "num_events_lost": 0, "reason": "x"}]}
    )  # fmt: skip
    assert client.wait_closed() == 4400
    assert run_row(sqlite_url, "eng", "run-a")["last_seq"] == eng.seq
    back = FakeEngineClient(collector.url, eng)
    assert back.connect() == eng.seq
    back.send_events(eng.steps(2))
    assert back.wait_ack(eng.seq) == eng.seq  # later real events are stored, not "duplicates"
    back.close()


def test_a_control_of_many_keys_stores_one_row_and_a_huge_one_none(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _live(collector)
    many = {f"k{i}": i for i in range(1000)}
    ack = send_control(collector.url, "eng", many, control_id="many")
    assert ack["ok"] is False and "unknown key" in ack["error"]
    huge = {f"k{i}": i for i in range(ingest.MAX_CONTROL_BYTES // 8)}
    reply = exchange(
        collector.url,
        {"type": "control", "id": "huge", "engine_id": "eng", "set": huge},
        "control_ack",
        "huge",
    )
    assert reply["type"] == "error" and "over" in reply["message"]
    client.send_events(eng.steps(1))
    client.wait_ack(eng.seq)
    ctl = wait_until(lambda: _controls(sqlite_url), what="refusal stored")
    assert list(ctl.request_id) == ["many"] and client.controls == []
    client.close()


def _healthz(collector: Any) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{collector.port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_failing_store_is_seen_and_nothing_unstored_is_acked(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _live(collector)
    durable = eng.seq
    assert _healthz(collector) == (200, "ok\n")
    store = collector._writer.store
    original = store.apply

    def failing(ops: list[Any]) -> list[Any]:
        if any(isinstance(op, Events) for op in ops):
            raise OSError("database or disk is full")
        return original(ops)

    store.apply = failing
    try:
        unstored = eng.steps(2)
        client.send_events(unstored)
        assert client.wait_closed() == 1011 and client.acked == durable
        status, body = _healthz(collector)
        assert status == 503 and "disk is full" in body
    finally:
        store.apply = original
    back = FakeEngineClient(collector.url, eng)
    assert back.connect() == durable  # resend from the durable seq
    back.send_events(unstored + eng.steps(1))
    assert back.wait_ack(eng.seq) == eng.seq
    assert stored_seqs(sqlite_url, "eng", "run-a") == list(range(1, eng.seq + 1))
    assert _healthz(collector) == (200, "ok\n")
    back.close()


def test_connections_are_capped_and_healthz_still_answers(
    collector_factory: Any, sqlite_url: str
) -> None:
    from contextlib import ExitStack

    from websockets.exceptions import InvalidStatus

    collector = collector_factory(sqlite_url, max_connections=2)
    with ExitStack() as stack:
        first = stack.enter_context(connect(collector.url + "/control", open_timeout=5, proxy=None))
        stack.enter_context(connect(collector.url + "/control", open_timeout=5, proxy=None))
        try:
            with connect(collector.url + "/ingest", open_timeout=5, proxy=None):
                raise AssertionError("a third connection was accepted")
        except InvalidStatus as exc:
            assert exc.response.status_code == 503
        assert _healthz(collector) == (200, "ok\n")
        first.close()
        wait_until(lambda: collector._n_conns < 2, what="a slot freed")
        assert list_engines(collector.url) == []  # a slot is free again


def test_the_kept_slots_hold_for_control_and_for_engines(
    collector_factory: Any, sqlite_url: str
) -> None:
    from contextlib import ExitStack

    from websockets.exceptions import InvalidStatus

    collector = collector_factory(
        sqlite_url, max_connections=16, publish_token="pub", control_token="ctl"
    )
    auth = {"Authorization": "Bearer ctl"}
    assert collector.config.reserved == 2

    def refused(path: str, headers: dict[str, str] | None = None) -> bool:
        try:
            with connect(collector.url + path, open_timeout=5, proxy=None,
                         additional_headers=headers):  # fmt: skip
                return False
        except InvalidStatus as exc:
            assert exc.response.status_code == 503
            return True

    with ExitStack() as stack:
        for _ in range(14):
            stack.enter_context(
                connect(
                    collector.url + "/control", open_timeout=5, proxy=None, additional_headers=auth
                )
            )
        assert refused("/control", auth)  # the last two slots are the engines'
        assert refused("/ingest")  # not for a connection without a credential
        eng = SyntheticEngine(seed=3, max_token_budget=2048, engine_id="eng", run_id="run-a")
        ws = stack.enter_context(
            connect(
                collector.url + "/ingest",
                open_timeout=5,
                proxy=None,
                additional_headers={"Authorization": "Bearer pub"},
            )
        )
        ws.send(json.dumps(eng.hello("pub")))
        assert json.loads(ws.recv(timeout=5))["type"] == "ack"


def _upgrade(port: int, source: str, headers: str = "") -> tuple[Any, bytes]:
    """A WebSocket upgrade to /ingest from ``source`` that then says nothing: the socket and the
    collector's answer's status line."""
    import socket

    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(
        (
            f"GET /ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\n{headers}\r\n"
        ).encode()
    )
    return s, s.recv(4096).split(b"\r\n", 1)[0]


def test_connections_without_a_hello_are_few_per_address_and_brief(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url, hello_timeout=1.0, publish_token="pub")
    socks = []
    try:
        for _ in range(8):
            s, status = _upgrade(collector.port, "127.0.0.2")
            socks.append(s)
            assert b" 101 " in status
        s, status = _upgrade(collector.port, "127.0.0.2")
        socks.append(s)
        assert b" 503 " in status  # a ninth from the same address
        s, status = _upgrade(collector.port, "127.0.0.3")
        socks.append(s)
        assert b" 101 " in status  # another address still gets in
        s, status = _upgrade(collector.port, "127.0.0.3", "Authorization: Bearer wrong\r\n")
        socks.append(s)
        assert b" 401 " in status
        # silent ones are closed after the hello timeout and their slots freed
        wait_until(lambda: collector._n_unidentified == 0, timeout=5, what="idle ones closed")
        s, status = _upgrade(collector.port, "127.0.0.2")
        socks.append(s)
        assert b" 101 " in status
    finally:
        for s in socks:
            s.close()
