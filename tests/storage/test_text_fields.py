"""Text an engine sends (request ids, classes, reasons, the hello's model and host) reaches the
store without control characters and within a bounded length, on every backend: PostgreSQL
refuses a NUL in a text column, so one such character would fail its batch on every resend."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from storage import db as dbm
from storage import ingest
from testkit.engines import FakeEngineClient, SyntheticEngine
from wire.events import SCHEMA_VERSION

from .helpers import stored_seqs

LONG = "x" * 5000


def _poison(events: list[dict[str, Any]]) -> None:
    """A NUL (and other control characters) in every text field; one request id far too long."""
    for ev in events:
        for c in ev.get("chunks") or []:
            c["request_id"] = _bad_id(c["request_id"])
        if ev["type"] == "request":
            ev["request_id"] = _bad_id(ev["request_id"])
            ev["traffic_class"] = f"{ev['traffic_class']}\x00\x01"
            if ev.get("finish_reason"):
                ev["finish_reason"] = "len\x00gth"
        elif ev["type"] == "step":
            ev["policy"] = "chunk\x00ed"
        elif ev["type"] in ("control", "gap"):
            ev["reason"] = "why\x00\x1b[31m"


def _bad_id(rid: str) -> str:
    return LONG + rid if rid.endswith("-0") else rid.replace("-", "\x00-", 1)


def test_control_characters_and_huge_strings_never_fail_a_batch(
    collector: Any, db_url: str
) -> None:
    eng = SyntheticEngine(engine_id="e", run_id="r", seed=1, concurrency=4)
    client = FakeEngineClient(collector.url, eng)
    hello = eng.hello

    def poisoned_hello(token: str | None = None) -> dict[str, Any]:
        h = hello(token)
        h.update(model="m\x00odel", host="h\x00ost\x7f", policy="chunk\x00ed")
        return h

    eng.hello = poisoned_hello  # type: ignore[method-assign]
    client.connect()
    events = eng.steps(6)
    eng.control("token_budget", 64, accepted=False, reason="x")
    events += eng.steps(2)
    eng.gap(eng.seq + 1, eng.seq + 3)  # sent with the next step's events
    events += eng.steps(2)
    _poison(events)
    client.send_events(events)
    assert client.wait_ack(events[-1]["seq"], timeout=20) == events[-1]["seq"]
    assert client.close_code is None
    client.close()
    assert stored_seqs(db_url, "e", "r") == [e["seq"] for e in events]
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            texts = [
                *conn.execute(text("SELECT model, host, policy FROM runs")).one(),
                *conn.execute(text("SELECT request_id FROM requests")).scalars(),
                *conn.execute(text("SELECT traffic_class FROM requests")).scalars(),
                *conn.execute(text("SELECT finish_reason FROM requests")).scalars(),
                *conn.execute(text("SELECT policy FROM steps")).scalars(),
                *conn.execute(text("SELECT reason FROM controls")).scalars(),
                *conn.execute(text("SELECT reason FROM gaps")).scalars(),
            ]
            ids = list(conn.execute(text("SELECT request_id FROM requests")).scalars())
    finally:
        db.dispose()
    texts = [t for t in texts if t is not None]
    assert all(t.isprintable() for t in texts), [t for t in texts if not t.isprintable()]
    assert all(len(t) <= ingest.MAX_TEXT_CHARS for t in texts)
    assert "model" in texts and "why[31m" in texts
    assert any(rid.startswith("xxxx") for rid in ids) and len(set(ids)) == len(ids)


def test_frame_cleans_the_text_of_accepted_events() -> None:
    ev = {
        "type": "request",
        "seq": 1,
        "kind": "arrived",
        "request_id": "a\x00b",
        "traffic_class": "c" * 10_000,
        "reason": "\ud800x",
    }
    msg = {"schema": SCHEMA_VERSION, "type": "events", "events": [ev]}
    verdict = ingest.frame(msg, engine_id="e", run_id="r", expected=1)
    [got] = verdict.accepted
    assert got["request_id"] == "ab"
    assert len(got["traffic_class"]) <= ingest.MAX_TEXT_CHARS
    assert got["traffic_class"] != ingest.clean_text("c" * 9_999)  # distinct stays distinct
    assert got["reason"] == "\ufffdx"
    assert got["kind"] == "arrived"
