"""The collector's side of a fleet (several collectors on one PostgreSQL store, ``storage.fleet``):
its heartbeat and its engines' rows, the controls other collectors hand it for its engines, a
control for an engine connected elsewhere handed to that engine's collector, the whole fleet in
the engine list, and the Prometheus service discovery answer (``GET /sd``)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Response

from storage import db as dbm
from storage import fleet
from storage.collector_core import CollectorCore
from wire import credentials

logger = logging.getLogger("storage.collector")

MAX_METRICS_URL_CHARS = 512


def metrics_url(value: Any) -> str | None:
    """A hello's ``metrics_url`` when it is an http(s) URL with a host (else None)."""
    if not isinstance(value, str) or len(value) > MAX_METRICS_URL_CHARS:
        return None
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises for a bad port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if not value.isprintable() or not value.isascii():
        return None
    return value


def sd_groups(
    engines: list[dict[str, Any]], collectors: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Prometheus ``http_sd_configs`` target groups: one per connected engine that told its
    ``/metrics`` address, one per collector (its ``/metrics`` is on its websocket port)."""
    groups: list[dict[str, Any]] = []
    for row in engines:
        url = row.get("metrics_url")
        if not row.get("connected") or not isinstance(url, str):
            continue
        parts = urlsplit(url)
        labels = {
            "__scheme__": parts.scheme,
            "__metrics_path__": parts.path or "/metrics",
            "chunkscope_role": "engine",
            "engine_id": str(row.get("engine_id")),
            "collector": str(row.get("collector") or ""),
        }
        if row.get("model"):
            labels["model"] = str(row["model"])
        if row.get("engine_kind"):
            labels["engine_kind"] = str(row["engine_kind"])
        groups.append({"targets": [parts.netloc], "labels": labels})
    for c in collectors:
        parts = urlsplit(str(c["url"]))
        scheme = "https" if parts.scheme == "wss" else "http"
        labels = {
            "__scheme__": scheme,
            "__metrics_path__": "/metrics",
            "chunkscope_role": "collector",
            "collector": str(c["url"]),
        }
        groups.append({"targets": [parts.netloc], "labels": labels})
    return groups


class FleetLink(CollectorCore):
    """Heartbeat, engine rows and control hand-off through the fleet's tables (PostgreSQL)."""

    _fleet: fleet.FleetStore | None = None
    _fleet_task: asyncio.Task[None] | None = None
    _fleet_view: list[dict[str, Any]] = []  # every engine of the fleet's table, latest read
    _fleet_collectors: list[dict[str, Any]] = []
    _fleet_problem: str | None = None

    @property
    def advertised_url(self) -> str:
        """The URL engines and other collectors reach this collector at."""
        url: str = self.config.advertise_url or self.url  # type: ignore[attr-defined]
        return url

    async def _fleet_start(self) -> None:
        """Join the fleet when the store is PostgreSQL (or ``config.fleet`` says so)."""
        on = self.config.fleet
        if on is None:
            on = self.config.db_url.startswith("postgresql")
        if not on:
            return
        db = dbm.connect(
            self.config.db_url,
            connect_timeout=self.config.db_connect_timeout,
            statement_timeout=self.config.db_statement_timeout,
        )
        collector_id = f"collector-{uuid.uuid4().hex[:12]}"
        self._fleet = fleet.FleetStore(db, collector_id, self.advertised_url)
        self._fleet_view = []
        self._fleet_collectors = []
        try:
            await self._fleet_beat()
        except Exception as exc:  # noqa: BLE001 - the loop tries again
            self._fleet_problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            logger.warning("fleet: first heartbeat failed: %s", self._fleet_problem)
        self._fleet_task = asyncio.ensure_future(self._fleet_loop())
        logger.info("fleet: %s at %s", collector_id, self.advertised_url)

    async def _fleet_stop(self) -> None:
        task, self._fleet_task = self._fleet_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._fleet is not None:
            try:
                await asyncio.to_thread(self._fleet.leave)
            except Exception as exc:  # noqa: BLE001 - the heartbeat ages out instead
                logger.warning("fleet: could not leave cleanly: %s", str(exc)[:200])
            self._fleet.db.dispose()
            self._fleet = None

    def _local_rows(self) -> list[dict[str, Any]]:
        """This collector's engines as the fleet's table holds them."""
        self._expire_kept_routes()  # type: ignore[attr-defined]
        return [dict(row) for row in self._seen.values()]

    async def _fleet_beat(self) -> None:
        assert self._fleet is not None
        store = self._fleet
        rows = self._local_rows()

        def work() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            store.beat(rows)
            return fleet.fleet_engines(store.db), fleet.live_collectors(store.db)

        self._fleet_view, self._fleet_collectors = await asyncio.to_thread(work)

    async def _fleet_loop(self) -> None:
        beats_every = max(1, round(fleet.HEARTBEAT_S / fleet.POLL_S))
        n = 0
        while True:
            try:
                n += 1
                if n % beats_every == 0:
                    await self._fleet_beat()
                assert self._fleet is not None
                for handed in await asyncio.to_thread(self._fleet.claim):
                    self._spawn(self._answer_handed(handed))
                if self._fleet_problem is not None:
                    logger.info("fleet: the store answers again")
                    self._fleet_problem = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the store may be away; tried again
                problem = f"{type(exc).__name__}: {str(exc)[:200]}"
                if problem != self._fleet_problem:
                    logger.warning("fleet: heartbeat or control poll failed: %s", problem)
                    self._fleet_problem = problem
            await asyncio.sleep(fleet.POLL_S)

    async def _answer_handed(self, handed: fleet.Handed) -> None:
        """Relay a control another collector handed here, and write the engine's answer."""
        assert self._fleet is not None
        try:
            answer = await self.relay(handed.message, handed.token, handed_over=True)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - the asking collector must get an answer
            logger.exception("fleet: relaying a handed control failed")
            answer = {"type": "control_ack", "ok": False, "error": f"relay failed: {exc}"}
        answer["collector"] = self.advertised_url
        try:
            await asyncio.to_thread(self._fleet.answer, handed.row_id, answer)
        except Exception as exc:  # noqa: BLE001 - the asking collector times out
            logger.warning("fleet: could not write a control's answer: %s", str(exc)[:200])

    def _owner_elsewhere(self, engine_id: str, run_id: Any) -> dict[str, Any] | None:
        """The fleet's row of ``engine_id`` (and ``run_id``, when named) while it is connected
        to another collector; None otherwise."""
        if self._fleet is None:
            return None
        for row in self._fleet_view:
            if row.get("engine_id") != engine_id or not row.get("connected"):
                continue
            if row.get("collector_id") == self._fleet.collector_id:
                return None
            if isinstance(run_id, str) and row.get("run_id") != run_id:
                return None
            return row
        return None

    async def _hand_over(
        self, owner: dict[str, Any], msg: dict[str, Any], cid: str, token: Any
    ) -> dict[str, Any]:
        """Hand a control to the collector that holds its engine and wait for the answer."""
        assert self._fleet is not None
        store = self._fleet
        engine_id = str(owner["engine_id"])
        why = credentials.may_steer(
            engine_id,
            token,
            shared=self.config.control_token,
            engines=self.config.engine_credentials,
        )
        if why:
            return {"type": "control_ack", "id": cid, "ok": False, "error": why}
        body = {k: v for k, v in msg.items() if k != "token"}
        body["id"] = cid
        row_id = await asyncio.to_thread(
            store.hand, str(owner["collector_id"]), engine_id, body, token
        )
        deadline = time.monotonic() + self.config.control_timeout + 5 * fleet.HEARTBEAT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(fleet.POLL_S / 2)
            answer = await asyncio.to_thread(store.answer_of, row_id)
            if answer is not None:
                answer.update(type="control_ack", id=cid)
                return answer
        await asyncio.to_thread(store.withdraw, row_id)
        self.metrics.controls.labels(outcome="timeout").inc()
        return {
            "type": "control_ack",
            "id": cid,
            "ok": False,
            "error": f"no answer from collector {owner.get('collector')} for engine "
            f"{engine_id} within {self.config.control_timeout:g} s",
        }

    def fleet_rows(self, local: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``local`` (this collector's rows, marked with its URL) and the fleet's other engines:
        an engine connected elsewhere is listed as its owning collector has it."""
        me = self.advertised_url
        rows = {str(r.get("engine_id")): {**r, "collector": me} for r in local}
        for row in self._fleet_view:
            engine_id = str(row.get("engine_id"))
            mine = rows.get(engine_id)
            if mine is not None and (mine.get("connected") or not row.get("connected")):
                continue
            rows[engine_id] = {k: v for k, v in row.items() if k != "collector_id"}
        return list(rows.values())

    def sd_response(self, connection: ServerConnection) -> Response:
        """``GET /sd``: Prometheus HTTP service discovery over the fleet (or this collector)."""
        local = self.fleet_rows(self._local_rows())
        collectors = self._fleet_collectors if self._fleet is not None else []
        if not any(c.get("url") == self.advertised_url for c in collectors):
            collectors = [*collectors, {"url": self.advertised_url}]
        body = json.dumps(sd_groups(local, collectors), indent=1).encode()
        headers = Headers(
            [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, body)
