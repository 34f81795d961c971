"""Bad input and faults on /ingest: each gets its close code or error reply, is counted in
/metrics, and leaves every other connection and everything acknowledged intact."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from storage import db as dbm
from storage import queries
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import stored_seqs


def _metrics(collector: Any) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{collector.port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(collector_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _refusals(collector: Any, reason: str) -> float:
    return _metrics(collector).get(f'collector_refusals_total{{reason="{reason}"}}', 0.0)


def _raw(collector: Any) -> Any:
    ws = connect(collector.url + "/ingest", open_timeout=10, proxy=None)
    ws.__enter__()
    return ws


def _closed_with(ws: Any) -> int | None:
    from websockets.exceptions import ConnectionClosed

    try:
        while True:
            ws.recv(timeout=10)
    except ConnectionClosed:
        pass
    return ws.close_code


@pytest.fixture
def sq_collector(collector_factory: Any, sqlite_url: str) -> Any:
    return collector_factory(sqlite_url, max_frame_bytes=64 * 1024, hello_timeout=5.0)


@pytest.fixture
def healthy(sq_collector: Any) -> FakeEngineClient:
    """A well-behaved engine connected alongside the bad ones."""
    eng = SyntheticEngine(engine_id="engine-good", run_id="run-good", seed=1)
    client = FakeEngineClient(sq_collector.url, eng)
    client.connect()
    client.send_events(eng.steps(5))
    client.wait_ack(eng.seq)
    yield client
    # still served after whatever the test did
    client.send_events(eng.steps(5))
    assert client.wait_ack(eng.seq) == eng.seq
    client.close()
    assert client.errors == []


@pytest.mark.parametrize(
    "first",
    [
        "{not json",
        "[1, 2, 3]",
        json.dumps({"schema": 1, "type": "events", "events": []}),  # no hello first
        json.dumps({**SyntheticEngine().hello(), "schema": 2}),  # wrong schema
        json.dumps({**SyntheticEngine().hello(), "clock": {"wall_ns": 1}}),  # no anchor
        json.dumps({**SyntheticEngine().hello(), "engine_id": ""}),
    ],
    ids=["malformed", "not-object", "no-hello", "schema", "no-clock", "empty-engine-id"],
)
def test_bad_first_frame_closes_4400(sq_collector: Any, healthy: Any, first: str) -> None:
    before = _refusals(sq_collector, "bad_input")
    ws = _raw(sq_collector)
    ws.send(first)
    assert _closed_with(ws) == 4400
    assert _refusals(sq_collector, "bad_input") == before + 1


def test_bad_frames_after_hello_close_4400_and_keep_what_was_acked(
    sq_collector: Any, healthy: Any, sqlite_url: str
) -> None:
    eng = SyntheticEngine(engine_id="engine-bad", run_id="run-bad", seed=2)
    bad_frames: list[str | bytes] = [
        "{oops",
        json.dumps({"schema": 99, "type": "events", "events": []}),
        json.dumps({"schema": 1, "type": "events", "events": [{"type": "step"}]}),  # no seq
        json.dumps({"schema": 1, "type": "events", "run_id": "another", "events": []}),
        b"\x00\x01",
    ]
    before = _refusals(sq_collector, "bad_input")
    for bad in bad_frames:
        client = FakeEngineClient(sq_collector.url, eng)
        assert client.connect() == eng.seq
        client.send_events(eng.steps(3))
        client.wait_ack(eng.seq)
        client._ws.send(bad)
        assert client.wait_closed() == 4400
    assert stored_seqs(sqlite_url, "engine-bad", "run-bad") == list(range(1, eng.seq + 1))
    assert _refusals(sq_collector, "bad_input") == before + len(bad_frames)


def test_oversized_frame_closes_1009(sq_collector: Any, healthy: Any, sqlite_url: str) -> None:
    eng = SyntheticEngine(engine_id="engine-big", run_id="run-big", seed=4)
    client = FakeEngineClient(sq_collector.url, eng)
    client.connect()
    client.send_events(eng.steps(3))
    acked = client.wait_ack(eng.seq)
    client.send(json.dumps({"schema": 1, "type": "events", "events": [], "pad": "x" * 100_000}))
    assert client.wait_closed() == 1009
    assert _refusals(sq_collector, "frame_too_big") == 1
    assert stored_seqs(sqlite_url, "engine-big", "run-big") == list(range(1, acked + 1))


def test_auth_token(collector_factory: Any, sqlite_url: str) -> None:
    c = collector_factory(sqlite_url, auth_token="s3cret")
    for token in (None, "wrong"):
        client = FakeEngineClient(c.url, SyntheticEngine(seed=5), token=token)
        with pytest.raises(Exception):  # noqa: B017 - closed before the first ack
            client.connect()
        assert client._ws.close_code == 4401
    client = FakeEngineClient(c.url, SyntheticEngine(seed=5), token="s3cret")
    assert client.connect() == 0
    client.close()
    with pytest.raises(InvalidStatus) as info:
        connect(c.url + "/control", open_timeout=10, proxy=None).__enter__()
    assert info.value.response.status_code == 401
    with connect(c.url + "/control?token=s3cret", open_timeout=10, proxy=None) as ws:
        ws.send(json.dumps({"type": "list_engines"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "engines"
    assert _refusals(c, "auth") == 3


def test_unknown_event_type_is_skipped_but_its_seq_counts(
    sq_collector: Any, healthy: Any, sqlite_url: str
) -> None:
    eng = SyntheticEngine(engine_id="engine-new", run_id="run-new", seed=6)
    client = FakeEngineClient(sq_collector.url, eng)
    client.connect()
    events = eng.steps(2)
    eng.seq += 1
    events.append({"type": "telepathy", "seq": eng.seq, "payload": 1})
    bad_seq = eng.seq + 1
    eng.seq += 1
    events.append({"type": "step", "seq": bad_seq, "step": "not a number"})
    events += eng.steps(2)
    client.send_events(events)
    assert client.wait_ack(eng.seq) == eng.seq
    errors = [client.wait_error(), client.wait_error()]
    assert {e["code"] for e in errors} == {"unknown_event_type", "bad_event"}
    assert next(e for e in errors if e["code"] == "bad_event")["seq"] == bad_seq
    client.close()
    assert _refusals(sq_collector, "unknown_event_type") == 1
    assert _refusals(sq_collector, "bad_event") == 1
    # every seq is stored or lies in a gap that says why: the two skipped ones are gaps of one
    assert stored_seqs(sqlite_url, "engine-new", "run-new") == list(range(1, eng.seq + 1))
    db = dbm.connect(sqlite_url, readonly=True)
    try:
        assert list(queries.steps(db, engine_id="engine-new").step) == [0, 1, 2, 3]
        gaps = queries.gaps(db, engine_id="engine-new")
        assert list(gaps.first_seq_lost) == [bad_seq - 1, bad_seq]
        assert "telepathy" in gaps.reason.iloc[0] and "unreadable" in gaps.reason.iloc[1]
    finally:
        db.dispose()


def test_seq_gap_and_order_get_error_replies(
    sq_collector: Any, healthy: Any, sqlite_url: str
) -> None:
    eng = SyntheticEngine(engine_id="engine-seq", run_id="run-seq", seed=8)
    client = FakeEngineClient(sq_collector.url, eng)
    client.connect()
    events = eng.steps(6)
    n = len(events)
    third = n // 3
    client.send_events(events[:third])
    client.send_events(events[third + 2 :])  # two events missing
    err = client.wait_error()
    assert err["code"] == "seq_gap" and err["expected"] == events[third]["seq"]
    # out of order inside a frame: the whole frame is refused
    client.send_events([events[third + 1], events[third]])
    err = client.wait_error()
    assert err["code"] == "seq_order"
    client.send_events(events[third:])  # the publisher resends from `expected`
    assert client.wait_ack(eng.seq) == eng.seq
    client.close()
    assert stored_seqs(sqlite_url, "engine-seq", "run-seq") == list(range(1, eng.seq + 1))
    assert _refusals(sq_collector, "seq_gap") == 1
    assert _refusals(sq_collector, "seq_order") == 1


def test_http_endpoints(sq_collector: Any) -> None:
    base = f"http://127.0.0.1:{sq_collector.port}"
    with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
        assert r.status == 200 and r.read() == b"ok\n"
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(base + "/nope", timeout=10)
    assert info.value.code == 404
    info.value.close()
    m = _metrics(sq_collector)
    for name in (
        "collector_frames_total",
        "collector_ingest_lag_seconds",
        "collector_write_batch_seconds_count",
        "collector_connected_engines",
    ):
        assert name in m, name


def test_metrics_count_events_and_connections(sq_collector: Any, healthy: Any) -> None:
    m = _metrics(sq_collector)
    assert m['collector_events_total{type="step"}'] == 5
    assert m["collector_connected_engines"] == 1
    assert m["collector_write_batch_seconds_count"] >= 1
