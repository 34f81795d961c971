"""The collector's /ingest side: an engine's hello and the registration of its run, its frames
after the hello (the rules are ``storage.ingest``'s; this carries out their verdicts), the
engine's row as its events and controls change it, and what is left when it disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from storage import frames, ingest
from storage.collector_admission import Admission
from storage.collector_config import (
    CLOSE_AUTH,
    CLOSE_BUSY,
    CLOSE_NOT_YOURS,
    CLOSE_REPLACED,
    CLOSE_STORE_ERROR,
    CLOSE_TOO_BIG,
    CLOSE_TOO_MANY_RUNS,
)
from storage.collector_core import IngestConn, note_applied
from storage.collector_fleet import metrics_url
from storage.collector_relay import ControlRelay
from storage.ingest import CLOSE_BAD_INPUT
from storage.store import Disconnect, Events, Hello, RunInfo
from wire import credentials
from wire.control import CAP_KEY

logger = logging.getLogger("storage.collector")


def _before(step: Any, settings_from_step: int | None) -> bool:
    """A step event that ran before the latest accepted control came in force."""
    return isinstance(step, int) and settings_from_step is not None and step < settings_from_step


def _stamp_declared(
    declared: OrderedDict[str, tuple[str, str | None]], events: list[dict[str, Any]]
) -> None:
    """Give the engine's control events for a relayed control the source (and, on an accepted
    change, the reason) its /control client declared."""
    for ev in events:
        if ev.get("type") != "control":
            continue
        got = declared.get(str(ev.get("request_id")))
        if got is None:
            continue
        ev["source"] = got[0]
        if got[1] is not None and ev.get("accepted"):
            ev["reason"] = ingest.clean_text(got[1])


class IngestHandling(ControlRelay, Admission):
    """Engine connections on /ingest, from their hello to their disconnection."""

    async def _close(self, ws: ServerConnection, code: int, reason: str) -> None:
        reasons = {CLOSE_BAD_INPUT: "bad_input", CLOSE_AUTH: "auth", CLOSE_TOO_MANY_RUNS: "runs"}
        self.metrics.refuse(reasons.get(code, str(code)))
        logger.warning("closing %s with %d: %s", ws.remote_address, code, reason)
        await ws.close(code, reason[:120])

    async def _ingest(self, ws: ServerConnection) -> None:
        """Serve one /ingest connection: its hello, then its frames until it closes."""
        hello = await self._await_hello(ws)
        if hello is None:
            return
        self._identified(ws)
        conn = IngestConn(ws=ws, engine_id=hello["engine_id"], run_id=hello["run_id"])
        self._take_hello(conn, hello)
        key = (conn.engine_id, conn.run_id)
        info = await self._register_run(ws, conn, hello, key)
        if info is None:
            return
        prev = self._by_run.get(info.run_key)
        if await self._run_refused(ws, key, info, prev):
            return
        self._go_live(conn, info, prev, key)
        logger.info(
            "engine %s run %s connected from %s (durable seq %d)",
            conn.engine_id,
            conn.run_id,
            ws.remote_address,
            info.last_seq,
        )
        await self._read_frames(conn, info.last_seq)

    async def _await_hello(self, ws: ServerConnection) -> dict[str, Any] | None:
        """The connection's hello, once it is well formed and carries a credential that may
        publish for its engine id; None when the connection was closed instead."""
        try:
            raw = await asyncio.wait_for(ws.recv(), self.config.hello_timeout)
        except TimeoutError:
            self._release(ws)  # its slot is free at once, not after the closing handshake
            await self._close(ws, CLOSE_BAD_INPUT, "no hello within the time limit")
            return None
        except ConnectionClosed as exc:
            self._closed_reason(exc)
            return None
        self.metrics.frames.inc()
        hello, why = ingest.check_hello_frame(raw)
        if hello is None:
            self._release(ws)
            await self._close(ws, CLOSE_BAD_INPUT, why)
            return None
        why = credentials.may_publish(
            hello["engine_id"],
            hello.get("token"),
            shared=self.config.ingest_token,
            engines=self.config.engine_credentials,
        )
        if why:
            self._release(ws)
            await self._close(ws, CLOSE_AUTH, why)
            return None
        return hello

    async def _register_run(
        self, ws: ServerConnection, conn: IngestConn, hello: dict[str, Any], key: tuple[str, str]
    ) -> RunInfo | None:
        """The store's registration of the hello's run; None when the store did not answer in
        time or failed (the connection is then closed, and the engine retries)."""
        self._hellos_pending[key] = self._hellos_pending.get(key, 0) + 1
        failed: Exception | None = None
        fut = self._submit(Hello(hello), want_result=True)
        assert fut is not None
        try:
            info: RunInfo = await asyncio.wait_for(
                asyncio.shield(fut), self.config.hello_answer_timeout
            )
        except TimeoutError:
            # The store has not answered: the engine retries. The hello stays queued in the
            # writer; its late answer must not leave the run marked connected (_late_hello).
            fut.add_done_callback(lambda f: self._late_hello(key, f))
            logger.error(
                "registering run %s/%s: no answer from the store within %g s",
                conn.engine_id,
                conn.run_id,
                self.config.hello_answer_timeout,
            )
            await ws.close(CLOSE_STORE_ERROR, "store busy; retry")
            return None
        except Exception as exc:
            failed = exc
            self._hello_answered(key)
        else:
            self._hello_answered(key)
        if failed is not None:
            logger.error(
                "registering run %s/%s failed: %s: %s",
                conn.engine_id,
                conn.run_id,
                type(failed).__name__,
                str(failed)[:200],
            )
            self._settle_disconnect(key)
            await ws.close(CLOSE_STORE_ERROR, f"store error: {type(failed).__name__}")
            return None
        return info

    async def _run_refused(
        self, ws: ServerConnection, key: tuple[str, str], info: RunInfo, prev: IngestConn | None
    ) -> bool:
        """Whether the hello may not speak for its run (wrong run_secret), or may not take over
        the run from its live connection ``prev`` (no run_secret to prove it); True when the
        connection was closed for that."""
        if info.refused:
            self._settle_disconnect(key)
            code = CLOSE_TOO_MANY_RUNS if info.too_many_runs else CLOSE_NOT_YOURS
            await self._close(ws, code, info.refused)
            return True
        if not ingest.may_take_over(proven=info.proven, live=prev is not None and prev.current):
            self._settle_disconnect(key)
            await self._close(
                ws,
                CLOSE_REPLACED,
                "this run is live on another connection and the hello has no run_secret to "
                "prove it is the same engine; retry once that connection is gone",
            )
            return True
        return False

    def _go_live(
        self, conn: IngestConn, info: RunInfo, prev: IngestConn | None, key: tuple[str, str]
    ) -> None:
        """Make ``conn`` its run's connection (replacing ``prev``), decide its control route,
        and list its engine as connected."""
        conn.run_key = info.run_key
        conn.expected = info.last_seq + 1
        if prev is not None:
            # The run's newer, proven connection takes over at once: the old one stops enqueueing.
            prev.current = False
            self._spawn(prev.ws.close(CLOSE_REPLACED, "replaced by a newer connection of this run"))
        self._by_run[info.run_key] = conn
        self._deferred_disconnect.pop(key, None)  # this hello marked the run connected again
        self._claim_route(conn, prev)
        if self._by_engine.get(conn.engine_id) is conn:
            self._refresh_seen(conn, connected=True)
        self.metrics.connected.set(len(self._by_run))

    async def _read_frames(self, conn: IngestConn, last_seq: int) -> None:
        """Acknowledge the durable seq, then take the connection's frames until it closes."""
        ws = conn.ws
        try:
            await ws.send(json.dumps({"type": "ack", "seq": last_seq}))
            async for raw in ws:
                self.metrics.frames.inc()
                if not await self._ingest_frame(conn, raw):
                    return
        except ConnectionClosed as exc:
            self._closed_reason(exc)
        finally:
            self._disconnected(conn)

    def _closed_reason(self, exc: ConnectionClosed) -> None:
        if exc.sent is not None and exc.sent.code == CLOSE_TOO_BIG:
            self.metrics.refuse("frame_too_big")

    def _disconnected(self, conn: IngestConn) -> None:
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_result(
                    {"ok": False, "error": f"engine {conn.engine_id} disconnected before answering"}
                )
        conn.pending.clear()
        if self._by_run.get(conn.run_key) is conn:
            del self._by_run[conn.run_key]
            if conn.current and conn.run_key:
                key = (conn.engine_id, conn.run_id)
                if self._hellos_pending.get(key):
                    # A newer hello of this run is queued in the writer (the engine gave up on
                    # this connection's): a Disconnect now would land after it and mark the new
                    # connection's run disconnected. Its answer decides (_settle_disconnect).
                    self._deferred_disconnect[key] = conn.run_key
                else:
                    self._submit(Disconnect(conn.run_key))
            if self._seen.get(conn.engine_id, {}).get("run_id") == conn.run_id:
                self._refresh_seen(conn, connected=False)
        self._drop(conn)
        self.metrics.connected.set(len(self._by_run))
        logger.info(
            "engine %s run %s disconnected (code %s)",
            conn.engine_id,
            conn.run_id,
            conn.ws.close_code,
        )

    def _hello_answered(self, key: tuple[str, str]) -> None:
        n = self._hellos_pending.get(key, 0) - 1
        if n > 0:
            self._hellos_pending[key] = n
        else:
            self._hellos_pending.pop(key, None)

    def _late_hello(self, key: tuple[str, str], fut: asyncio.Future[Any]) -> None:
        """The store answered a hello whose connection gave up waiting: a run it marked
        connected has no connection, unless a newer one of the run is live or on its way."""
        self._hello_answered(key)
        info = None if fut.cancelled() or fut.exception() is not None else fut.result()
        if isinstance(info, RunInfo) and not info.refused and info.run_key not in self._by_run:
            self._deferred_disconnect.setdefault(key, info.run_key)
        self._settle_disconnect(key)

    def _settle_disconnect(self, key: tuple[str, str]) -> None:
        """A hello of ``key`` was answered without registering a connection: the Disconnect that
        waited for it goes to the writer now, unless another hello is still on its way or the
        run is live again."""
        run_key = self._deferred_disconnect.get(key)
        if run_key is None or self._hellos_pending.get(key):
            return
        del self._deferred_disconnect[key]
        if run_key not in self._by_run:
            self._submit(Disconnect(run_key))

    def _take_hello(self, conn: IngestConn, h: dict[str, Any]) -> None:
        conn.max_token_budget = h.get("max_token_budget")
        conn.token_budget = h.get("token_budget")
        conn.policy = h.get("policy")
        conn.long_prefill_token_threshold = h.get(CAP_KEY)
        conn.model = h.get("model")
        policies = h.get("policies")
        if isinstance(policies, list) and all(isinstance(p, str) for p in policies):
            conn.policies = tuple(policies)
        kind = h.get("engine_kind")
        conn.engine_kind = kind if isinstance(kind, str) else None
        conn.metrics_url = metrics_url(h.get("metrics_url"))

    async def _ingest_frame(self, conn: IngestConn, raw: str | bytes) -> bool:
        """Handle one frame after the hello (the rules are ``storage.ingest``'s; this carries
        out the verdict); False when the connection was closed."""
        if conn.failed:
            await conn.ws.close(CLOSE_STORE_ERROR, "store error; resend")
            return False
        msg = frames.decode_plain(raw)  # the common frame, typed; any other as JSON
        if msg is None:
            msg, why = ingest.parse(raw)
            if msg is None:
                await self._close(conn.ws, CLOSE_BAD_INPUT, why)
                return False
        verdict = ingest.frame(
            msg, engine_id=conn.engine_id, run_id=conn.run_id, expected=conn.expected
        )
        if verdict.control_ack is not None:
            self._control_ack(conn, verdict.control_ack)
            return True
        if verdict.close is not None:
            await self._close(conn.ws, CLOSE_BAD_INPUT, verdict.close)
            return False
        if verdict.duplicates:
            self.metrics.duplicates.inc(verdict.duplicates)
        if verdict.accepted:
            await self._backpressure()
            if not conn.current or conn.failed:
                return False
            if self._no_room(len(raw)):
                await self._refuse_busy(conn, len(raw))
                return False
            conn.expected = verdict.expected
            if verdict.accepted[-1].get("type") == "goodbye":
                conn.said_goodbye = True
            if conn.declared:
                _stamp_declared(conn.declared, verdict.accepted)
            self._note_progress(conn, verdict.accepted)
            self._submit(Events(conn.run_key, verdict.accepted, tag=conn), nbytes=len(raw))
        if verdict.error is not None:
            self.metrics.refuse(verdict.error["code"])
            await self._send(conn.ws, verdict.error)
        return True

    async def _refuse_busy(self, conn: IngestConn, nbytes: int) -> None:
        """Too much waits for the writer to take this frame: close the connection with 1013
        without accepting it (nothing of it is acknowledged), so the engine keeps it in its
        buffer and resends it from the durable seq when it is back."""
        self.metrics.refuse("busy")
        logger.warning(
            "engine %s run %s: a frame of %d bytes refused, %d bytes wait for the store "
            "(--max-pending-bytes %d); closing 1013, the engine resends it later",
            conn.engine_id,
            conn.run_id,
            nbytes,
            self._pending_bytes,
            self.config.max_pending_bytes,
        )
        await conn.ws.close(CLOSE_BUSY, "collector busy: too much waits for the store; resend")

    def _note_progress(self, conn: IngestConn, events: list[dict[str, Any]]) -> None:
        for ev in reversed(events):
            if ev.get("type") == "step":
                step, end_ns = ev.get("step"), ev.get("end_ns")
                if isinstance(step, int):
                    conn.last_step = step
                if isinstance(end_ns, int):
                    conn.last_seen_ns = end_ns
                if _before(step, conn.settings_from_step):
                    break
                budget, policy = ev.get("token_budget"), ev.get("policy")
                if isinstance(budget, int):
                    conn.token_budget = budget
                if isinstance(policy, str):
                    conn.policy = policy
                cap = ev.get(CAP_KEY)
                if isinstance(cap, int) and not isinstance(cap, bool):
                    conn.long_prefill_token_threshold = cap
                break
        for ev in events:
            if ev.get("type") == "control" and ev.get("accepted"):
                note_applied(conn, ev.get("applied_at_step"))
                if ev.get("key") == "token_budget" and isinstance(ev.get("new_value"), int):
                    conn.token_budget = ev["new_value"]
                elif ev.get("key") == "policy" and isinstance(ev.get("new_value"), str):
                    conn.policy = ev["new_value"]
                elif ev.get("key") == CAP_KEY and isinstance(ev.get("new_value"), int):
                    conn.long_prefill_token_threshold = ev["new_value"]
        if self._by_engine.get(conn.engine_id) is conn:
            self._refresh_seen(conn, connected=True)
