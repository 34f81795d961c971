"""The engine-side telemetry publisher: engine events over a websocket to the collector.

``Publisher.publish`` (constant time, any thread, never touches the network) gives each event
its ``seq`` and keeps it in an :class:`~engine.telemetry.buffer.EventBuffer` until the collector
acknowledges it. A background thread runs an asyncio loop that connects to the collector's
``/ingest`` (``websockets.asyncio.client``), sends the ``hello``, resends from the collector's
first ``ack`` + 1, then sends batches (by count, a linger and a frame-size bound) and releases
what each ``ack`` covers. After a frame that did not fill a batch it sleeps ``linger_s`` (default
0.1 s) and polls the buffer again, so while events keep coming ``publish`` never wakes it (only
the first event after an idle spell does) and a frame carries what ``linger_s`` gathered: each
frame and each wake-up cost that thread a few hundred us (asyncio and websockets code, the
wake-up itself on a virtual machine), so their rate is most of its CPU. It reconnects with
exponential backoff and jitter; while no collector answers the engine serves normally and the
buffer holds events (memory, then spill files, then a declared ``gap``). Controls the collector
relays on the same connection are applied by an ``apply_control`` coroutine as tasks, so the
reader never waits on the engine. The wire is ``docs/telemetry.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from engine.telemetry.buffer import (
    BufferLimits,
    BufferStats,
    EventBuffer,
    encode_or_placeholder,
)
from wire import strict_json
from wire.control import ControlRefused, control_mac, same_secret
from wire.events import SCHEMA_VERSION

logger = logging.getLogger(__name__)

ApplyControl = Callable[[dict[str, Any], str | None], Awaitable[dict[str, Any]]]


def normalize_collector_url(url: str) -> str:
    """``ws://host:port`` or ``ws://host:port/ingest`` (also wss) as the ingest endpoint URL;
    ValueError naming the URL when it is not one (a port that is not a number included)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("collector URL must be a ws:// or wss:// URL such as ws://127.0.0.1:8765")
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(
            f"collector URL must look like ws://HOST:PORT or ws://HOST:PORT/ingest, got {url!r}"
        )
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number from 0 to 65535
    except ValueError as exc:
        raise ValueError(f"collector URL {url!r}: {exc}") from None
    path = parts.path.rstrip("/")
    if not path:
        path = "/ingest"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def collector_urls(urls: str | Sequence[str]) -> list[str]:
    """A failover list of collectors: a comma-separated string (or a sequence) of collector
    URLs, each normalized (``normalize_collector_url``); ValueError naming the first bad one.
    The publisher uses the first it reaches and moves to the next when one goes away."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    if not items or all(not isinstance(u, str) or not u.strip() for u in items):
        raise ValueError("collector URL must be a ws:// or wss:// URL such as ws://127.0.0.1:8765")
    out: list[str] = []
    for i, item in enumerate(items, 1):
        try:
            url = normalize_collector_url(item)
        except ValueError as exc:
            raise ValueError(f"collector URL {i} of {len(items)} is not valid: {exc}") from None
        if url not in out:
            out.append(url)
    return out


def new_run_id() -> str:
    return f"run-{uuid.uuid4().hex}"


@dataclass
class PublisherStats(BufferStats):
    connected: bool
    reconnects: int  # connections made after the first
    connect_failures: int
    frames_sent: int
    events_sent: int  # resends included
    controls: int


class Publisher:
    """Streams one engine run's events to a collector (see the module docstring).

    ``hello`` returns the engine's fields of the hello (model, host, pid, policy, token_budget,
    max_token_budget, kv_blocks_total, block_size, config, clock), read at each connect.
    ``apply_control(set, id)`` applies a relayed control and returns ``applied_at_step``, ``old``
    and ``new``, raising :class:`ControlRefused` (or ValueError / TypeError) to refuse it.
    ``control_token``: when set, a relayed control must carry it.
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        engine_id: str,
        hello: Callable[[], dict[str, Any]],
        run_id: str | None = None,
        token: str | None = None,
        apply_control: ApplyControl | None = None,
        control_token: str | None = None,
        limits: BufferLimits | None = None,
        max_batch_events: int = 512,
        linger_s: float = 0.1,
        max_frame_bytes: int = 1 << 20,
        max_event_bytes: int | None = None,
        max_inflight_events: int = 8192,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 3.0,
        open_timeout_s: float = 5.0,
        ack_timeout_s: float = 10.0,
        compression: str | None = None,
    ) -> None:
        # the failover list: the first collector that answers, the next when it goes away
        self.urls = collector_urls(url)
        self._url_index = 0
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
        for name, value in (("max_batch_events", max_batch_events),
                            ("max_frame_bytes", max_frame_bytes),
                            ("max_inflight_events", max_inflight_events)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.engine_id = engine_id
        self.run_id = run_id or new_run_id()
        # Proves to the collector that a reconnect is this run (docs/telemetry.md): it never
        # leaves this process except in the hello, and the collector keeps only its hash.
        self.run_secret = secrets.token_urlsafe(32)
        self._hello = hello
        self._token = token or None
        self._apply_control = apply_control
        self._control_token = control_token or None
        self.buffer = EventBuffer(self.run_id, limits)
        self.buffer.on_data = self._wake_sender
        self.max_batch_events = max_batch_events
        self.linger_s = linger_s
        self.max_frame_bytes = max_frame_bytes
        # one event larger than this is sent as an "unencodable" placeholder saying why (the
        # store records it as a gap): resent whole, it would be refused on every reconnect
        self.max_event_bytes = max_event_bytes or max_frame_bytes
        self._oversized = 0
        self.max_inflight_events = max_inflight_events
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.open_timeout_s = open_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.compression = compression
        self._frame_head = (
            f'{{"schema":{SCHEMA_VERSION},"type":"events",'
            f'"engine_id":{json.dumps(self.engine_id)},"run_id":{json.dumps(self.run_id)},'
            '"events":['
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._stopping = False
        self._flush_deadline = 0.0
        self._goodbye_seq: int | None = None
        self._connected = False
        self._num_connects = 0
        self._connect_failures = 0
        self._frames_sent = 0
        self._events_sent = 0
        self._controls = 0
        self._control_tasks: set[asyncio.Task[None]] = set()
        self._acked_cond = threading.Condition()
        self._last_problem: str | None = None

    # --- engine side --------------------------------------------------------------------------
    def publish(self, event: Any) -> None:
        """Queue one event (an ``wire.events`` event or a dict with ``type``); constant time,
        thread-safe, never blocks on the network. Usable as an engine listener."""
        if isinstance(event, dict) and not isinstance(event.get("type"), str):
            raise ValueError(f"an event needs a string 'type', got keys {sorted(event)[:10]}")
        if not self._stopping:
            self.buffer.publish(event)

    def start(self) -> Publisher:
        if self._thread is not None:
            raise RuntimeError("this publisher was started already")
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._thread_main, args=(ready,), name="chunkscope-telemetry", daemon=True
        )
        self._thread.start()
        ready.wait(5.0)
        logger.info(
            "telemetry: publishing engine %s run %s to %s",
            self.engine_id,
            self.run_id,
            ", ".join(self.urls),
        )
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Send what is left (waiting at most ``timeout`` s), a ``goodbye``, and close."""
        if self._stopping:
            return
        self._stopping = True
        self._flush_deadline = time.monotonic() + timeout
        self._goodbye_seq = self.buffer.publish(
            {"type": "goodbye", "time_ns": time.monotonic_ns(), "reason": "engine stopping"}
        )
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._signal_stop)
            thread.join(timeout + 2.0)
            if thread.is_alive():
                logger.warning("telemetry: the publisher thread did not stop in time")
        stats = self.buffer.stats()
        if stats.acked_seq < stats.last_seq:
            logger.warning(
                "telemetry: stopping with %d events the collector never acknowledged "
                "(seq %d to %d)",
                stats.last_seq - stats.acked_seq,
                stats.acked_seq + 1,
                stats.last_seq,
            )
        self.buffer.close()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def url(self) -> str:
        """The collector this publisher is connected to, or tries next."""
        return self.urls[self._url_index]

    def stats(self) -> PublisherStats:
        b = self.buffer.stats()
        return PublisherStats(
            **vars(b),
            connected=self._connected,
            reconnects=max(0, self._num_connects - 1),
            connect_failures=self._connect_failures,
            frames_sent=self._frames_sent,
            events_sent=self._events_sent,
            controls=self._controls,
        )

    def wait_acked(self, seq: int | None = None, timeout: float = 10.0) -> bool:
        """Block until the collector acknowledged ``seq`` (default: every event so far)."""
        target = self.buffer.last_seq if seq is None else seq
        deadline = time.monotonic() + timeout
        with self._acked_cond:
            while self.buffer.acked_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._acked_cond.wait(min(left, 0.1))
        return True

    # --- the network thread -------------------------------------------------------------------
    def _thread_main(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._main(ready))
        except Exception:  # noqa: BLE001 - logged; the engine keeps serving without telemetry
            logger.exception("telemetry: the publisher thread failed; events are no longer sent")

    def _wake_sender(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # loop closed: stopping
                loop.call_soon_threadsafe(wake.set)

    def _signal_stop(self) -> None:
        assert self._stop is not None and self._wake is not None
        self._stop.set()
        self._wake.set()

    def _done(self) -> bool:
        """Stopping and either everything (the goodbye included) is acknowledged or time is up."""
        if not self._stopping:
            return False
        if self._goodbye_seq is not None and self.buffer.acked_seq >= self.buffer.last_seq:
            return True
        return time.monotonic() >= self._flush_deadline

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        if self._stopping:
            self._stop.set()
        ready.set()
        backoff = self.backoff_initial_s
        failed_in_a_row = 0  # connection attempts without a session, over the failover list
        while not self._done():
            acked_before = self._num_connects
            # at shutdown, one attempt (per collector of the list) to reach one that is away
            last_try = self._stopping and failed_in_a_row + 1 >= len(self.urls)
            try:
                await self._connect_once()
            except (OSError, TimeoutError, WebSocketException, _SessionError) as exc:
                self._note_problem(exc)
            except Exception:  # noqa: BLE001 - a bug here must not end telemetry for good
                logger.exception("telemetry: the collector session failed; reconnecting")
            finally:
                self._set_connected(False)
            if self._done():
                break
            if self._num_connects > acked_before:
                backoff = self.backoff_initial_s  # a session got going: start over
                failed_in_a_row = 0
            else:
                self._connect_failures += 1
                failed_in_a_row += 1
                if last_try:
                    break
            if len(self.urls) > 1:
                # failover: the next collector of the list (it resends from the durable seq
                # that collector reports, from the store they share)
                self._url_index = (self._url_index + 1) % len(self.urls)
                if failed_in_a_row % len(self.urls):
                    continue  # the rest of the list first; the backoff once all failed
            delay = min(backoff, self.backoff_max_s) * random.uniform(0.5, 1.0)
            backoff = min(backoff * 2, self.backoff_max_s)
            if self._stopping:
                delay = min(delay, max(0.0, self._flush_deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            if self._stopping and self._stop.is_set():
                self._stop.clear()  # one immediate attempt after stop; then wait as usual
        for task in list(self._control_tasks):
            task.cancel()

    def _note_problem(self, exc: BaseException) -> None:
        problem = f"{type(exc).__name__}: {exc}"
        rcvd = getattr(exc, "rcvd", None)
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status == 401:  # the token in the handshake's Authorization header
            problem = "the collector refused the --publish-token (HTTP 401 at the handshake)"
        elif rcvd is not None and rcvd.code == 4401:
            problem = f"the collector refused the --publish-token (close 4401: {rcvd.reason})"
        elif rcvd is not None and rcvd.code == 4403:
            problem = f"the collector holds this run for another secret (4403: {rcvd.reason})"
        elif rcvd is not None and rcvd.code == 4400:
            problem = f"the collector refused the hello (close 4400: {rcvd.reason})"
        elif rcvd is not None and rcvd.code == 4429:
            problem = f"the collector refused a new run of this engine id (4429: {rcvd.reason})"
        elif rcvd is not None and rcvd.code == 1013:  # its --max-pending-bytes: resent later
            problem = f"the collector is busy (close 1013: {rcvd.reason})"
        if problem != self._last_problem:  # say it once, not at every retry
            self._last_problem = problem
            logger.warning(
                "telemetry: collector %s unavailable (%s); retrying with backoff, events are kept",
                self.url,
                problem,
            )
        else:
            logger.debug("telemetry: collector still unavailable: %s", problem)

    def _set_connected(self, value: bool) -> None:
        self._connected = value

    async def _connect_once(self) -> None:
        open_timeout = self.open_timeout_s
        if self._stopping:
            open_timeout = max(0.1, min(open_timeout, self._flush_deadline - time.monotonic()))
        # The publish token also goes in the handshake: the collector then counts this
        # connection as an engine's from the start, never among the ones without a hello yet.
        token = self._token
        headers = {"Authorization": f"Bearer {token}"} if token and _header_safe(token) else None
        async with connect(
            self.url,
            additional_headers=headers,
            open_timeout=open_timeout,
            close_timeout=2.0,
            compression=self.compression,
            proxy=None,
        ) as ws:
            await self._session(ws)

    async def _session(self, ws: ClientConnection) -> None:
        try:
            fields = self._hello()
        except Exception as exc:  # noqa: BLE001 - e.g. the engine is gone; retried later
            raise _SessionError(f"could not read the engine's hello fields: {exc}") from exc
        hello = {
            **fields,
            "schema": SCHEMA_VERSION,
            "type": "hello",
            "engine_id": self.engine_id,
            "run_id": self.run_id,
            "run_secret": self.run_secret,
        }
        if self._token is not None:
            hello["token"] = self._token
        await ws.send(json.dumps(hello, default=str))
        try:
            first = await asyncio.wait_for(ws.recv(), self.ack_timeout_s)
        except TimeoutError as exc:
            raise _SessionError(f"no ack within {self.ack_timeout_s:.0f} s of the hello") from exc
        msg = _parse(first)
        if msg.get("type") != "ack" or not _is_seq(msg.get("seq")):
            raise _SessionError(f"expected an ack after the hello, got {str(first)[:200]!r}")
        acked = int(msg["seq"])
        self._on_ack(acked)
        self._num_connects += 1
        self._set_connected(True)
        self._last_problem = None
        logger.info(
            "telemetry: connected to %s (run %s); collector holds up to seq %d, sending from %d",
            self.url,
            self.run_id,
            acked,
            acked + 1,
        )
        session = _Session(cursor=acked)
        if acked < self.buffer.acked_seq:
            # e.g. the run was deleted from the store (a prune) while the engine was away: the
            # collector starts it again at ``acked``; what it acknowledged before is gone
            session.lost_from = acked + 1
        reader = asyncio.create_task(self._read(ws, session))
        sender = asyncio.create_task(self._send(ws, session))
        try:
            done, _ = await asyncio.wait({reader, sender}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises what ended the session
        finally:
            for task in (reader, sender):
                task.cancel()
            await asyncio.gather(reader, sender, return_exceptions=True)

    def _on_ack(self, seq: int) -> None:
        self.buffer.ack(seq)
        with self._acked_cond:
            self._acked_cond.notify_all()

    async def _read(self, ws: ClientConnection, session: _Session) -> None:
        async for raw in ws:
            msg = _parse(raw)
            kind = msg.get("type")
            if kind == "ack" and _is_seq(msg.get("seq")):
                self._on_ack(int(msg["seq"]))
                session.acked.set()
                if self._done():
                    return
            elif kind == "error":
                self._on_error(msg, session)
            elif kind == "control":
                task = asyncio.create_task(self._control(ws, msg))
                self._control_tasks.add(task)
                task.add_done_callback(self._control_tasks.discard)
            else:
                logger.debug("telemetry: ignoring a collector message: %s", str(raw)[:200])
        raise _SessionError("the collector closed the connection")

    def _on_error(self, msg: dict[str, Any], session: _Session) -> None:
        if msg.get("code") == "seq_gap" and _is_seq(msg.get("expected")):
            expected = int(msg["expected"])
            first_held = self.buffer.first_held_seq
            if first_held is not None and expected < first_held:
                if expected > self.buffer.acked_seq:
                    raise _SessionError(
                        f"the collector expects seq {expected}, which is no longer held "
                        f"(lowest held: {first_held})"
                    )
                session.lost_from = expected  # acknowledged before, released, now missing
            else:
                logger.warning("telemetry: the collector asks to resend from seq %d", expected)
                session.resend_from = expected
            assert self._wake is not None
            self._wake.set()
        else:
            logger.warning("telemetry: the collector reported an error: %s", msg)

    async def _send(self, ws: ClientConnection, session: _Session) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            if session.lost_from is not None:
                declared = self._declare_lost(session.lost_from)
                session.lost_from = None
                session.carry.clear()
                if declared is not None:
                    frame, session.cursor = declared
                    await ws.send(frame)
            if session.resend_from is not None:
                session.cursor = min(session.cursor, session.resend_from - 1)
                session.resend_from = None
                session.carry.clear()
            if self._done():
                return
            if session.cursor - self.buffer.acked_seq >= self.max_inflight_events:
                session.acked.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(session.acked.wait(), 1.0)
                continue
            lingering = self.linger_s > 0 and not self._stopping
            entries = self._next_entries(session)
            if not entries:  # idle: sleep until the next publish wakes this loop
                wake.clear()
                if not self._next_entries(session, arm=True):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), 1.0 if self._stopping else None)
                    if lingering:
                        await asyncio.sleep(self.linger_s)  # let a batch gather
                continue
            frame, last_seq, n = self._frame(entries, session)
            await ws.send(frame)
            session.cursor = last_seq
            self._frames_sent += 1
            self._events_sent += n
            if lingering and n == len(entries) and n < self.max_batch_events:
                # While events keep coming, poll every linger_s: the engine's thread does not
                # wake this loop (no call into it, no syscall on its path) until a poll finds
                # nothing. Stop and resend requests wait at most linger_s.
                await asyncio.sleep(self.linger_s)

    def _next_entries(self, session: _Session, *, arm: bool = False) -> list[tuple[int, str]]:
        if session.carry and session.carry[0][0] == session.cursor + 1:
            return list(session.carry)
        session.carry.clear()
        taken = self.buffer.take(session.cursor, self.max_batch_events, arm=arm)
        limit = self.max_event_bytes
        out = []
        for seq, item in taken:
            text = item if isinstance(item, str) else encode_or_placeholder(seq, item)
            if len(text) > limit >> 2 and (len(text) > limit or len(text.encode()) > limit):
                text = self._oversized_placeholder(seq, text)
            out.append((seq, text))
        return out

    def _oversized_placeholder(self, seq: int, text: str) -> str:
        """The ``unencodable`` event sent in place of one over ``max_event_bytes``."""
        size = len(text.encode())
        self._oversized += 1
        if self._oversized & (self._oversized - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
            logger.error(
                "telemetry: event seq %d is %d bytes, over the %d-byte limit of one event: sent "
                "as a placeholder the collector stores as a gap (%d such event(s) so far)",
                seq,
                size,
                self.max_event_bytes,
                self._oversized,
            )
        reason = (
            f"an event of {size} bytes, over the publisher's limit of {self.max_event_bytes} "
            "bytes for one event (a client-chosen request id of that size?)"
        )
        return json.dumps({"type": "unencodable", "seq": seq, "reason": reason})

    def _declare_lost(self, first: int) -> tuple[str, int] | None:
        """A frame of one ``gap`` event declaring ``first`` up to the seq before the lowest held
        one lost (everything published so far when none is held), at that last seq (a gap may
        declare its own seq lost), and that seq; None when nothing is missing. For seqs the
        collector acknowledged before and no longer holds: the buffer released them."""
        first_held = self.buffer.first_held_seq
        last = first_held - 1 if first_held is not None else self.buffer.last_seq
        if last < first:
            return None
        logger.warning(
            "telemetry: the collector no longer holds seqs %d to %d, which it acknowledged "
            "before (its run was deleted?); declaring them lost and going on",
            first,
            last,
        )
        gap = {
            "type": "gap",
            "seq": last,
            "first_seq_lost": first,
            "last_seq_lost": last,
            "num_events_lost": last - first + 1,
            "reason": (
                f"the collector no longer holds seqs {first} to {last}, which it acknowledged "
                "before (the run was deleted from the store, or the store lost them)"
            ),
            "time_ns": time.monotonic_ns(),
        }
        return self._frame_head + json.dumps(gap, separators=(",", ":")) + "]}", last

    def _frame(self, entries: list[tuple[int, str]], session: _Session) -> tuple[str, int, int]:
        """A frame of the first entries that fit ``max_frame_bytes`` (at least one); the rest
        are carried to the next frame."""
        parts: list[str] = []
        size = len(self._frame_head) + 2
        last_seq = entries[0][0] - 1
        for seq, text in entries:
            if parts and size + len(text) + 1 > self.max_frame_bytes:
                break
            parts.append(text)
            size += len(text) + 1
            last_seq = seq
        session.carry = deque(entries[len(parts) :])
        return self._frame_head + ",".join(parts) + "]}", last_seq, len(parts)

    async def _control(self, ws: ClientConnection, msg: dict[str, Any]) -> None:
        self._controls += 1
        cid = msg.get("id")
        reply: dict[str, Any] = {"type": "control_ack", "id": cid}
        try:
            changes = msg.get("set")
            if not isinstance(changes, dict) or not changes:
                raise ControlRefused(
                    'a control needs "set": an object such as {"token_budget": 512}'
                )
            if self._control_token is not None and not self._control_authentic(msg, changes):
                raise ControlRefused(
                    "missing or wrong control token: this engine takes controls made with its "
                    "--control-token"
                )
            if self._apply_control is None:
                raise ControlRefused("this engine does not accept control from the collector")
            result = await self._apply_control(changes, cid if isinstance(cid, str) else None)
            reply.update(ok=True, **result)
        except (ControlRefused, ValueError, TypeError) as exc:
            reply.update(ok=False, error=str(exc))
            if not getattr(exc, "recorded", False) and isinstance(msg.get("set"), dict):
                self._publish_refusals(msg["set"], cid, str(exc))
        except Exception as exc:  # noqa: BLE001 - the collector must always get an answer
            logger.exception("telemetry: applying control %r failed", cid)
            reply.update(ok=False, error=f"the engine failed to apply it: {exc}")
        logger.info("telemetry: control %s from the collector: %s", cid, reply)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(json.dumps(reply, default=str))

    def _control_authentic(self, msg: dict[str, Any], changes: dict[str, Any]) -> bool:
        """The relayed control was made with this engine's control token: its ``mac`` (what a
        collector of this version sends) or, from an older collector, the token itself."""
        assert self._control_token is not None
        cid = msg.get("id")
        mac = msg.get("mac")
        if isinstance(mac, str) and isinstance(cid, str):
            want = control_mac(
                self._control_token,
                control_id=cid,
                engine_id=self.engine_id,
                run_id=self.run_id,
                changes=changes,
            )
            return same_secret(mac, want)
        return same_secret(msg.get("token"), self._control_token)

    def _publish_refusals(self, changes: dict[str, Any], cid: Any, reason: str) -> None:
        """Record a control refused here (the engine never saw it) as control events."""
        for key, value in changes.items():
            self.publish(
                {
                    "type": "control",
                    "key": key,
                    "old_value": None,
                    "new_value": value,
                    "accepted": False,
                    "time_ns": time.monotonic_ns(),
                    "source": "collector",
                    "applied_at_step": None,
                    "reason": reason,
                    "request_id": cid,
                }
            )


class _SessionError(Exception):
    """The collector session cannot go on (reconnect)."""


@dataclass
class _Session:
    """One connection's sending state (created inside the publisher's event loop)."""

    cursor: int  # highest seq sent on this connection (or acknowledged at its start)
    resend_from: int | None = None
    # the collector no longer holds seqs from this one on, which it acknowledged before and the
    # buffer has released: declare them lost (a gap) before sending anything else
    lost_from: int | None = None
    carry: deque[tuple[int, str]] = field(default_factory=deque)  # encoded, not yet sent
    acked: asyncio.Event = field(default_factory=asyncio.Event)


def _parse(raw: str | bytes) -> dict[str, Any]:
    try:
        msg = strict_json.loads(raw)
    except ValueError:
        logger.warning("telemetry: the collector sent something that is not JSON: %r", raw[:200])
        return {}
    return msg if isinstance(msg, dict) else {}


def _header_safe(token: str) -> bool:
    """A token an HTTP header can carry as it is (printable ASCII, no surrounding spaces)."""
    return token.isascii() and token.isprintable() and token == token.strip()


def _is_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
