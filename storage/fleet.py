"""The fleet's tables: several collectors on one PostgreSQL store, and how they find each other.

Each collector of a fleet keeps, in the store they share:

- its row in ``fleet_collectors`` (its address and a heartbeat every ``HEARTBEAT_S``);
- a row in ``fleet_engines`` for each engine connected to it (the engine's row as the collector
  lists it, its ``/metrics`` address, which collector holds its connection);
- the controls handed to it in ``fleet_controls``: a collector that gets a control for an engine
  connected elsewhere writes it there for the owning collector, which polls every ``POLL_S``,
  relays it over the engine's connection and writes the engine's answer back; the asking
  collector reads the answer and deletes the row.

A collector whose heartbeat is older than ``STALE_AFTER_S`` is gone: its engines count as not
connected (they are failing over). Synchronous SQL only; the collector runs it on threads
(``storage.collector_fleet``) and the dashboard reads :func:`fleet_engines`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert

from storage import schema

HEARTBEAT_S = 1.0  # a collector's heartbeat, and how often it writes its engines' rows
POLL_S = 0.1  # how often a collector looks for controls handed to it, and for answers
STALE_AFTER_S = 10.0  # a collector silent this long is gone
FORGET_CONTROLS_S = 300.0  # handed-over controls nobody collected are deleted after this


@dataclass(frozen=True)
class Handed:
    """A control handed to this collector: its row id, the control message and the token the
    asking collector's client presented."""

    row_id: int
    message: dict[str, Any]
    token: str | None


class FleetStore:
    """One collector's side of the fleet's tables (a PostgreSQL store)."""

    def __init__(self, db: Engine, collector_id: str, url: str) -> None:
        self.db = db
        self.collector_id = collector_id
        self.url = url
        self.started = time.time()
        self._written: dict[str, str] = {}  # engine id -> the row last written (JSON)

    def beat(self, rows: list[dict[str, Any]]) -> None:
        """The heartbeat: this collector's row, and the rows of the engines it holds (written
        when they changed; ``connected`` False for one that left)."""
        now = time.time()
        c = schema.fleet_collectors
        e = schema.fleet_engines
        with self.db.begin() as conn:
            stmt = pg_insert(c).values(
                collector_id=self.collector_id,
                url=self.url,
                host=socket.gethostname(),
                pid=os.getpid(),
                started=self.started,
                heartbeat=now,
            )
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=[c.c.collector_id], set_={"heartbeat": now, "url": self.url}
                )
            )
            for row in rows:
                engine_id = str(row["engine_id"])
                text = json.dumps(row, default=str, sort_keys=True)
                if self._written.get(engine_id) == text:
                    continue
                values = {
                    "run_id": str(row.get("run_id")),
                    "collector_id": self.collector_id,
                    "connected": bool(row.get("connected")),
                    "info": text,
                    "metrics_url": row.get("metrics_url"),
                    "updated": now,
                }
                if values["connected"]:
                    conn.execute(
                        pg_insert(e)
                        .values(engine_id=engine_id, **values)
                        .on_conflict_do_update(index_elements=[e.c.engine_id], set_=values)
                    )
                else:  # only while this collector is the one it names
                    conn.execute(
                        update(e)
                        .where(e.c.engine_id == engine_id, e.c.collector_id == self.collector_id)
                        .values(**values)
                    )
                self._written[engine_id] = text
            fc = schema.fleet_controls
            conn.execute(delete(fc).where(fc.c.created < now - FORGET_CONTROLS_S))

    def leave(self) -> None:
        """A clean stop: this collector's engines are no longer connected through it."""
        e = schema.fleet_engines
        c = schema.fleet_collectors
        with self.db.begin() as conn:
            conn.execute(
                update(e)
                .where(e.c.collector_id == self.collector_id)
                .values(connected=False, updated=time.time())
            )
            conn.execute(delete(c).where(c.c.collector_id == self.collector_id))

    # -- controls -----------------------------------------------------------------------------

    def hand(self, collector_id: str, engine_id: str, msg: dict[str, Any], token: Any) -> int:
        """Hand ``msg`` to ``collector_id``; returns the row id to wait on."""
        fc = schema.fleet_controls
        body = json.dumps({"msg": msg, "token": token if isinstance(token, str) else None})
        with self.db.begin() as conn:
            result = conn.execute(
                pg_insert(fc)
                .values(
                    collector_id=collector_id,
                    engine_id=engine_id,
                    message=body,
                    created=time.time(),
                )
                .returning(fc.c.id)
            )
            return int(result.scalar_one())

    def answer_of(self, row_id: int) -> dict[str, Any] | None:
        """The answer to a handed control (deleting its row), or None while there is none."""
        fc = schema.fleet_controls
        with self.db.begin() as conn:
            text = conn.execute(select(fc.c.answer).where(fc.c.id == row_id)).scalar()
            if text is None:
                return None
            conn.execute(delete(fc).where(fc.c.id == row_id))
        answer = json.loads(text)
        return answer if isinstance(answer, dict) else None

    def withdraw(self, row_id: int) -> None:
        fc = schema.fleet_controls
        with self.db.begin() as conn:
            conn.execute(delete(fc).where(fc.c.id == row_id))

    def claim(self) -> list[Handed]:
        """The controls handed to this collector and not claimed yet (now claimed)."""
        fc = schema.fleet_controls
        with self.db.begin() as conn:
            rows = conn.execute(
                update(fc)
                .where(fc.c.collector_id == self.collector_id, fc.c.claimed.is_(None))
                .values(claimed=time.time())
                .returning(fc.c.id, fc.c.message)
            ).all()
        out = []
        for row_id, text in rows:
            body = json.loads(text)
            token = body.get("token")
            out.append(Handed(int(row_id), body["msg"], token if isinstance(token, str) else None))
        return out

    def answer(self, row_id: int, answer: dict[str, Any]) -> None:
        fc = schema.fleet_controls
        with self.db.begin() as conn:
            conn.execute(
                update(fc)
                .where(fc.c.id == row_id)
                .values(answer=json.dumps(answer, default=str), answered=time.time(), message="{}")
            )


def fleet_engines(db: Engine, now: float | None = None) -> list[dict[str, Any]]:
    """Every engine of the fleet's table: its row as its collector lists it, with
    ``collector`` (that collector's URL), ``collector_id`` and ``connected`` (False when its
    collector is gone), connected ones first."""
    now = time.time() if now is None else now
    e, c = schema.fleet_engines, schema.fleet_collectors
    with db.connect() as conn:
        rows = conn.execute(
            select(
                e.c.engine_id,
                e.c.run_id,
                e.c.collector_id,
                e.c.connected,
                e.c.info,
                e.c.metrics_url,
                c.c.url,
                c.c.heartbeat,
            ).select_from(e.outerjoin(c, c.c.collector_id == e.c.collector_id))
        ).all()
    out = []
    for r in rows:
        try:
            info = json.loads(r.info)
        except ValueError:
            info = {}
        alive = r.heartbeat is not None and now - r.heartbeat <= STALE_AFTER_S
        info.update(
            engine_id=r.engine_id,
            run_id=r.run_id,
            collector_id=r.collector_id,
            collector=r.url,
            connected=bool(r.connected) and alive,
            metrics_url=r.metrics_url,
        )
        out.append(info)
    out.sort(key=lambda row: (not row["connected"], row["engine_id"]))
    return out


def live_collectors(db: Engine, now: float | None = None) -> list[dict[str, Any]]:
    """The collectors whose heartbeat is recent: ``collector_id``, ``url``, ``heartbeat``."""
    now = time.time() if now is None else now
    c = schema.fleet_collectors
    with db.connect() as conn:
        rows = conn.execute(
            select(c.c.collector_id, c.c.url, c.c.heartbeat).where(
                c.c.heartbeat >= now - STALE_AFTER_S
            )
        ).all()
    return [dict(r._mapping) for r in rows]
