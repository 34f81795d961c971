"""A flood of idle connections (loopback, bounded) never locks a real engine or a control out.

Hundreds of WebSocket connections to ``/ingest`` that never say hello, reopened as the collector
closes them, from several loopback addresses (127.0.0.1 among them, the engine's own): the real
publisher still connects and every seq it publishes is acknowledged, and a control still reaches
it and is answered.
"""

from __future__ import annotations

import base64
import os
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

from engine.telemetry import Publisher
from storage.control import send_control
from testkit.collector import collector_in_thread
from testkit.engines import SyntheticEngine
from tests.engine.telemetry.test_telemetry_publisher import WAIT_S

FLOOD_SOCKETS = 300
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(1, 11)]


class IdleFlood:
    """Keeps ``n`` WebSocket upgrades to ``/ingest`` open and silent, reopening each one the
    collector closes (or refuses), until stopped."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.n = n
        self.opened = 0
        self.upgraded = 0  # answered 101
        self.refused = 0  # answered 503
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-flood", daemon=True)

    def _open(self) -> None:
        src = FLOOD_SOURCES[self.opened % len(FLOOD_SOURCES)]
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.bind((src, 0))
            s.connect(("127.0.0.1", self.port))
            key = base64.b64encode(os.urandom(16)).decode()
            s.sendall(
                (
                    f"GET /ingest HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                ).encode()
            )
        except OSError:
            s.close()
            return
        s.setblocking(False)
        self._socks.append(s)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._socks) < self.n and not self._stop.is_set():
                self._open()
            readable, _, _ = select.select(self._socks, [], [], 0.05)
            for s in readable:
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if data.startswith(b"HTTP/1.1 101"):
                    self.upgraded += 1
                elif data.startswith(b"HTTP/1.1 503"):
                    self.refused += 1
                if not data or not data.startswith(b"HTTP/1.1 101"):
                    self._socks.remove(s)
                    s.close()
        for s in self._socks:
            s.close()

    def __enter__(self) -> IdleFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_flood_of_idle_connections_locks_out_neither_an_engine_nor_a_control(
    tmp_path: Path,
) -> None:
    db_url = f"sqlite:///{tmp_path / 'flood.db'}"
    syn = SyntheticEngine(engine_id="eng-flood", run_id="run-flood", seed=5)
    fields = {k: v for k, v in syn.hello().items() if k not in ("engine_id", "run_id")}
    applied: list[dict[str, Any]] = []

    async def apply(changes: dict[str, Any], cid: str | None) -> dict[str, Any]:
        applied.append(changes)
        return {"applied_at_step": syn.step, "old": {"token_budget": 0}, "new": changes}

    with collector_in_thread(db_url, publish_token="pub-tok", control_token="ctl-tok") as c:
        with IdleFlood(c.port, FLOOD_SOCKETS) as flood:
            deadline = time.monotonic() + 10
            while flood.opened < FLOOD_SOCKETS and time.monotonic() < deadline:
                time.sleep(0.05)
            assert flood.opened >= FLOOD_SOCKETS
            pub = Publisher(
                c.url, engine_id=syn.engine_id, run_id=syn.run_id, hello=lambda: fields,
                token="pub-tok", apply_control=apply, linger_s=0.01, backoff_initial_s=0.05,
                backoff_max_s=0.5,
            ).start()  # fmt: skip
            try:
                events = syn.steps(50)
                for ev in events:
                    pub.publish({k: v for k, v in ev.items() if k != "seq"})
                assert pub.wait_acked(timeout=WAIT_S), pub.stats()
                assert pub.stats().acked_seq == len(events)
                ack = send_control(
                    c.url, "eng-flood", {"token_budget": 256}, token="ctl-tok",
                    auth_token="ctl-tok", timeout=10,
                )  # fmt: skip
                assert ack["ok"] is True, ack
                assert applied == [{"token_budget": 256}]
            finally:
                pub.close(timeout=WAIT_S)
            assert flood.refused > 0  # the flood was held back, not merely slow
