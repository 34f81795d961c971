"""Small helpers shared by the storage tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from storage import db as dbm


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if (not value.empty) if hasattr(value, "empty") else value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def stored_seqs(db_url: str, engine_id: str, run_id: str) -> list[int]:
    """Every seq stored for a run, over all event tables, sorted (duplicates kept)."""
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            key = conn.execute(
                text("SELECT id FROM runs WHERE engine_id = :e AND run_id = :r"),
                {"e": engine_id, "r": run_id},
            ).scalar_one()
            seqs: list[int] = []
            for table in ("steps", "request_events", "gaps"):
                seqs += [
                    row[0]
                    for row in conn.execute(
                        text(f"SELECT seq FROM {table} WHERE run_key = :k"), {"k": key}
                    )
                ]
            seqs += [
                row[0]
                for row in conn.execute(
                    text(
                        "SELECT seq FROM controls WHERE engine_id = :e AND run_id = :r "
                        "AND seq IS NOT NULL"
                    ),
                    {"e": engine_id, "r": run_id},
                )
            ]
        return sorted(seqs)
    finally:
        db.dispose()


def run_row(db_url: str, engine_id: str, run_id: str) -> dict[str, Any]:
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            row = conn.execute(
                text("SELECT * FROM runs WHERE engine_id = :e AND run_id = :r"),
                {"e": engine_id, "r": run_id},
            ).first()
        return dict(row._mapping) if row is not None else {}
    finally:
        db.dispose()


def hello_close_code(url: str, hello: dict[str, Any]) -> int | None:
    """Say ``hello`` to the collector at ``url`` on a fresh connection: the close code, or None
    when it was acked."""
    with connect(url + "/ingest", open_timeout=5, proxy=None) as ws:
        ws.send(json.dumps(hello))
        try:
            reply = json.loads(ws.recv(timeout=5))
        except ConnectionClosed:
            return ws.close_code
        assert reply["type"] == "ack", reply
        return None
