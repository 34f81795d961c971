"""The collector's control relay: which live run of an engine id a control goes to (the control
route, and the run that keeps it while it reconnects), the /control clients, and the relay of
one control to its engine and of the engine's answer back."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from storage import ingest
from storage.collector_config import MAX_CONTROLS_IN_FLIGHT, presented_token
from storage.collector_core import IngestConn, note_applied
from storage.collector_fleet import FleetLink
from storage.store import CollectorControl
from wire import credentials
from wire.control import (
    CONTROL_KEYS,
    ControlRefused,
    check_changes,
    control_mac,
    relay_declaration,
)

logger = logging.getLogger("storage.collector")

MAX_DECLARED = 64  # per engine connection: relayed controls whose events are still to come


class _Refusal(Exception):
    """A control the collector refuses: the reason, the outcome it is counted under, and the
    parameter it concerns (if any)."""

    def __init__(self, reason: str, outcome: str, param: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.outcome = outcome
        self.param = param


class ControlRelay(FleetLink):
    """Control routes, /control clients and the relay of controls to engines."""

    # -- control routes -----------------------------------------------------------------------

    def _claim_route(self, conn: IngestConn, prev: IngestConn | None) -> None:
        """Decide whether a run that just connected (``prev``: the connection it replaced)
        takes its engine id's control route: not while the route is kept for another run that
        is reconnecting, nor while another run of the id is live."""
        self._expire_kept_routes()
        route = self._by_engine.get(conn.engine_id)
        kept = self._route_kept.get(conn.engine_id)
        if kept is not None and kept[0] == conn.run_key:
            del self._route_kept[conn.engine_id]  # the run that held the route is back
            kept = None
        if route is None and kept is not None:
            logger.warning(
                "engine id %s: run %s connected while the control route is kept for run %s, "
                "which left without a goodbye (up to %g s for it to come back); controls that "
                "name no run_id go nowhere meanwhile",
                conn.engine_id,
                conn.run_id,
                kept[1],
                self.config.route_grace,
            )
        elif route is None or route is prev or route.run_key == conn.run_key:
            self._by_engine[conn.engine_id] = conn
        else:
            # Another run of this engine id is live (two engines started with one --engine-id,
            # or one posing as the other): the control route stays with the first.
            logger.warning(
                "engine id %s: run %s connected while run %s is live; controls stay routed to "
                "%s (a control may name its run_id)",
                conn.engine_id,
                conn.run_id,
                route.run_id,
                route.run_id,
            )

    def _drop(self, conn: IngestConn) -> None:
        """Take ``conn`` off its engine id's control route. A run that said goodbye leaves it to
        another live run of the same engine id, if any; one that left without a goodbye keeps
        it for its reconnection grace (it is reconnecting, and only it can prove its run)."""
        if self._by_engine.get(conn.engine_id) is not conn:
            return
        del self._by_engine[conn.engine_id]
        if conn.said_goodbye or self.config.route_grace <= 0:
            self._pass_route(conn.engine_id)
        else:
            self._route_kept[conn.engine_id] = (
                conn.run_key,
                conn.run_id,
                time.monotonic() + self.config.route_grace,
            )

    def _pass_route(self, engine_id: str) -> None:
        """The route of ``engine_id`` to one of its live runs, if any."""
        for other in self._by_run.values():
            if other.engine_id == engine_id and other.current:
                self._by_engine[engine_id] = other
                self._refresh_seen(other, connected=True)
                return

    def _expire_kept_routes(self) -> None:
        """Routes kept for runs whose grace is over pass to a live run of their engine id."""
        if not self._route_kept:
            return
        now = time.monotonic()
        for engine_id, (_, _, until) in list(self._route_kept.items()):
            if until <= now:
                del self._route_kept[engine_id]
                if engine_id not in self._by_engine:
                    self._pass_route(engine_id)

    def _live(self, engine_id: str, run_id: str) -> IngestConn | None:
        for conn in self._by_run.values():
            if conn.engine_id == engine_id and conn.run_id == run_id and conn.current:
                return conn
        return None

    # -- /control ----------------------------------------------------------------------------

    def _control_ack(self, conn: IngestConn, msg: dict[str, Any]) -> None:
        cid = msg.get("id")
        fut = conn.pending.pop(str(cid), None) if cid is not None else None
        if fut is None:
            logger.warning("control_ack for unknown id %r from %s", cid, conn.engine_id)
            return
        if not fut.done():
            fut.set_result(msg)

    async def _control_client(self, ws: ServerConnection) -> None:
        self.metrics.control_clients.inc()
        presented = presented_token(ws.request) if ws.request is not None else None
        # a client holding one engine's own control token sees and steers that engine only
        scope = credentials.steers_only(presented, self.config.engine_credentials)
        in_flight: set[asyncio.Task[Any]] = set()
        try:
            async for raw in ws:
                msg, why = ingest.check_control_message(raw)
                if msg is None:
                    self.metrics.refuse("control_bad_input")
                    await self._send(ws, {"type": "error", "code": "bad_input", "message": why})
                    continue
                kind = msg.get("type")
                if kind == "list_engines":
                    await self._send(ws, self.engines_reply(msg, only=scope))
                elif kind == "control":
                    if len(in_flight) >= MAX_CONTROLS_IN_FLIGHT:
                        self.metrics.refuse("control_busy")
                        await self._send(
                            ws,
                            {
                                "type": "error",
                                "code": "busy",
                                "message": f"at most {MAX_CONTROLS_IN_FLIGHT} controls in flight "
                                "per client; wait for an answer",
                            },
                        )
                        continue
                    # Several controls from one client may be in flight at once.
                    task = asyncio.ensure_future(self._relay_and_answer(ws, msg, presented))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    self.metrics.refuse("unknown_message")
                    await self._send(
                        ws,
                        {
                            "type": "error",
                            "code": "unknown_message",
                            "message": f"unknown message type {kind!r}: use list_engines or "
                            "control",
                        },
                    )
        except ConnectionClosed:
            pass
        finally:
            self.metrics.control_clients.dec()

    def list_engines(self) -> list[dict[str, Any]]:
        return [dict(v) for v in self._seen.values()]

    def engines_reply(self, msg: dict[str, Any], only: str | None = None) -> dict[str, Any]:
        """The ``engines`` reply: connected engines first, then the others, at most
        ``ingest.MAX_ENGINES_LISTED`` from ``offset`` (``next_offset`` when more follow);
        ``only``: that engine id alone."""
        self._expire_kept_routes()
        rows = self.list_engines()
        if self._fleet is not None:  # the whole fleet, with the collector each is connected to
            rows = self.fleet_rows(rows)
        if only is not None:
            rows = [r for r in rows if r.get("engine_id") == only]
        return ingest.engines_page(rows, msg.get("offset"))

    async def _relay_and_answer(
        self, ws: ServerConnection, msg: dict[str, Any], presented: str | None
    ) -> None:
        answer = await self.relay(msg, presented)
        await self._send(ws, answer)

    async def relay(
        self, msg: dict[str, Any], presented: str | None = None, *, handed_over: bool = False
    ) -> dict[str, Any]:
        """Check a control, forward it to its engine, and return the control_ack to send back.
        ``presented``: the token the /control client connected with; a ``token`` in the
        message itself (older clients) takes its place. An engine connected to another
        collector of the fleet gets it through that collector (``handed_over``: it came from
        one, and goes no further)."""
        cid = msg.get("id")
        cid = (
            ingest.clean_text(str(cid), ingest.MAX_ID_CHARS)
            if cid is not None
            else f"collector-{next(self._ids)}"
        )
        engine_id = msg.get("engine_id")
        run_id = msg.get("run_id")  # optional: which live run of the engine id
        new = msg.get("set")
        self._expire_kept_routes()
        conn = self._control_target(engine_id, run_id)
        token = msg.get("token")
        if token is None:
            token = presented
        if conn is None and not handed_over and isinstance(engine_id, str):
            # connected to another collector of the fleet: the run whose route is kept here
            # (it failed over), or any run when none is kept
            owner = self._owner_elsewhere(engine_id, run_id)
            kept = self._route_kept.get(engine_id)
            if owner is not None and (kept is None or kept[1] == owner.get("run_id")):
                return await self._hand_over(owner, msg, cid, token)
        try:
            self._check_target(engine_id, run_id, conn, token)
            assert conn is not None and isinstance(engine_id, str)
            declared = self._check_control(msg, cid, conn, new)
            assert isinstance(new, dict)
            answer = await self._forward(conn, cid, new, token, declared)
        except _Refusal as refusal:
            return self._refuse(msg, cid, engine_id, conn, refusal)
        self._settle_answer(conn, new, answer)
        return {**answer, "type": "control_ack", "id": cid}

    def _control_target(self, engine_id: Any, run_id: Any) -> IngestConn | None:
        """Which live connection a control naming ``engine_id`` (and ``run_id``, if any) goes
        to: the named run's, or else the engine id's control route."""
        if isinstance(engine_id, str):
            if isinstance(run_id, str):
                return self._live(engine_id, run_id)
            if run_id is None:
                return self._by_engine.get(engine_id)
        return None

    def _check_target(
        self, engine_id: Any, run_id: Any, conn: IngestConn | None, token: Any
    ) -> None:
        """Refuse a control whose token may not steer its engine, or that names no engine, a
        malformed run, or an engine (run) that is not connected."""
        why = credentials.may_steer(
            engine_id if isinstance(engine_id, str) else "",
            token,
            shared=self.config.control_token,
            engines=self.config.engine_credentials,
        )
        if why:
            raise _Refusal(why, "token")
        if not isinstance(engine_id, str) or not engine_id:
            raise _Refusal("engine_id must be a non-empty string", "bad_request")
        if run_id is not None and not isinstance(run_id, str):
            raise _Refusal("run_id must be a string when given", "bad_request")
        if conn is None:
            if engine_id in self._seen:
                which = f"run {run_id} of engine {engine_id}" if run_id else f"engine {engine_id}"
                raise _Refusal(f"{which} is not connected", "disconnected")
            raise _Refusal(f"unknown engine {engine_id[:128]!r}", "unknown_engine")

    @staticmethod
    def _check_control(
        msg: dict[str, Any], cid: str, conn: IngestConn, new: Any
    ) -> tuple[str, str | None]:
        """Refuse changes the engine cannot take, a bad source or reason, or an id already
        pending; else the (source, reason) the client declared."""
        try:
            check_changes(new, conn.max_token_budget, conn.policies)
        except ControlRefused as exc:
            code = "bad_request" if exc.param is None else "bad_value"
            if exc.param is not None and exc.param not in CONTROL_KEYS:
                code = "bad_key"
            raise _Refusal(exc.reason[:500], code, exc.param) from None
        try:
            declared = relay_declaration(msg)
        except ControlRefused as exc:
            raise _Refusal(exc.reason, "bad_request", exc.param) from None
        if cid in conn.pending:
            raise _Refusal(f"a control with id {cid!r} is already pending", "bad_request")
        return declared

    async def _forward(
        self,
        conn: IngestConn,
        cid: str,
        new: dict[str, Any],
        token: Any,
        declared: tuple[str, str | None],
    ) -> dict[str, Any]:
        """Send the control to its engine and wait for the engine's answer; refused when the
        engine leaves or does not answer in time."""
        assert self._loop is not None
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        conn.pending[cid] = fut
        self._declare(conn, cid, declared)
        out: dict[str, Any] = {"type": "control", "id": cid, "set": new}
        if isinstance(token, str):
            # Never the token itself: a MAC under it, bound to this engine, run and control id.
            out["mac"] = control_mac(
                token, control_id=cid, engine_id=conn.engine_id, run_id=conn.run_id, changes=new
            )
        try:
            await conn.ws.send(json.dumps(out, allow_nan=False))
            answer = await asyncio.wait_for(fut, self.config.control_timeout)
        except ConnectionClosed:
            raise _Refusal(
                f"engine {conn.engine_id} disconnected before answering", "disconnected"
            ) from None
        except TimeoutError:
            raise _Refusal(
                f"no answer from engine {conn.engine_id} within {self.config.control_timeout:g} s",
                "timeout",
            ) from None
        finally:
            conn.pending.pop(cid, None)
        if "type" not in answer:
            # The engine dropped before answering (see _disconnected): the collector refuses.
            raise _Refusal(str(answer.get("error")), "disconnected")
        return answer

    @staticmethod
    def _declare(conn: IngestConn, cid: str, declared: tuple[str, str | None]) -> None:
        """Keep the source and reason a client declared for its control, to stamp them on the
        engine's control events (only when they say more than the collector's default)."""
        source, why = declared
        if source != "collector" or why is not None:
            conn.declared[cid] = (source, why)
            conn.declared.move_to_end(cid)
            while len(conn.declared) > MAX_DECLARED:
                conn.declared.popitem(last=False)

    def _settle_answer(self, conn: IngestConn, new: dict[str, Any], answer: dict[str, Any]) -> None:
        """Count the engine's answer; an accepted change is in force on its engine's row."""
        ok = bool(answer.get("ok"))
        self.metrics.controls.labels(outcome="accepted" if ok else "refused_by_engine").inc()
        if ok:
            for key, value in new.items():
                setattr(conn, key, value)
            note_applied(conn, answer.get("applied_at_step"))
            self._refresh_seen(conn, connected=True)

    def _refuse(
        self,
        msg: dict[str, Any],
        cid: str,
        engine_id: Any,
        conn: IngestConn | None,
        refusal: _Refusal,
    ) -> dict[str, Any]:
        """Count and log a refused control, record it in the store where it names a known
        engine, and return the control_ack that refuses it."""
        reason, outcome = refusal.reason, refusal.outcome
        self.metrics.controls.labels(outcome=outcome).inc()
        self.metrics.refuse(f"control_{outcome}")
        # One row at most per refused message, and none for an engine never seen: checked
        # before anything is stored, so no message can make the writer work per key.
        row = ingest.control_refusal_row(
            msg,
            refusal.param,
            known_engine=isinstance(engine_id, str) and engine_id in self._seen,
        )
        if row is not None and isinstance(engine_id, str):
            key, value = row
            run = conn.run_id if conn is not None else self._seen[engine_id].get("run_id")
            self._submit(
                CollectorControl(
                    engine_id=engine_id,
                    run_id=run,
                    key=key,
                    old_value=getattr(conn, key, None) if conn is not None and key else None,
                    new_value=value,
                    reason=ingest.clean_text(reason, 500),
                    request_id=cid,
                )
            )
        logger.info("control %s for %r refused: %s", cid, str(engine_id)[:128], reason[:500])
        return {"type": "control_ack", "id": cid, "ok": False, "error": reason}
