"""The telemetry publisher against a small fake collector (a websockets server on port 0)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from engine.telemetry import BufferLimits, Publisher, normalize_collector_url
from wire.control import ControlRefused, control_mac
from wire.events import ControlEvent, RequestEvent

WAIT_S = 20.0


class FakeCollector:
    """Stores events idempotently on (run_id, seq), acks the highest durable seq after each
    frame, accepts gaps a ``gap`` event declares, and can misbehave on request."""

    def __init__(self, port: int = 0, *, ack: bool = True, extra_fields: bool = False) -> None:
        self.port = port
        self.ack = ack
        self.extra_fields = extra_fields
        self.close_after_frames: int | None = None  # drop the connection (no ack) after N frames
        self.refuse_first_frame = False  # answer the first frame with a seq_gap error
        self.hellos: list[dict[str, Any]] = []
        self.frames: list[dict[str, Any]] = []
        self.raw_sizes: list[int] = []
        self.stored: dict[int, dict[str, Any]] = {}
        self.received: list[int] = []  # every seq received, duplicates included
        self.durable = 0
        self.replies: dict[str, dict[str, Any]] = {}
        self._conn: ServerConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> FakeCollector:
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()

            async def main() -> None:
                self._server = await serve(self._handler, "127.0.0.1", self.port)
                self.port = self._server.sockets[0].getsockname()[1]
                started.set()
                await self._server.wait_closed()

            self._loop.run_until_complete(main())
            self._loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(WAIT_S)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        if self._thread is not None:
            self._thread.join(WAIT_S)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ingest"

    # --- the ingest protocol ----------------------------------------------------------------
    async def _handler(self, ws: ServerConnection) -> None:
        hello = json.loads(await ws.recv())
        assert hello["type"] == "hello" and hello["schema"] == 1
        self.hellos.append(hello)
        self._conn = ws
        await ws.send(json.dumps(self._ack_msg()))
        frames_here = 0
        async for raw in ws:
            msg = json.loads(raw)
            if msg.get("type") == "control_ack":
                self.replies[msg["id"]] = msg
                continue
            assert msg["type"] == "events" and msg["schema"] == 1
            assert msg["run_id"] == hello["run_id"] and msg["engine_id"] == hello["engine_id"]
            frames_here += 1
            self.frames.append(msg)
            self.raw_sizes.append(len(raw))
            if self.refuse_first_frame:
                self.refuse_first_frame = False
                await ws.send(json.dumps({"type": "error", "code": "seq_gap", "expected": 1}))
                continue
            error = self._store(msg["events"])
            if error is not None:
                await ws.send(json.dumps(error))
                continue
            if self.close_after_frames is not None and frames_here >= self.close_after_frames:
                self.close_after_frames = None
                # drop the last frame's rows as if the commit never happened, then vanish
                last = [e["seq"] for e in msg["events"]]
                with self._lock:
                    for seq in last:
                        self.stored.pop(seq, None)
                    self.durable = min(self.durable, min(last) - 1)
                await ws.close()
                return
            if self.ack:
                await ws.send(json.dumps(self._ack_msg()))

    def _ack_msg(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": "ack", "seq": self.durable}
        if self.extra_fields:
            msg["ingest_lag_ms"] = 1.5
            msg["future"] = {"nested": [1, 2]}
        return msg

    def _store(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        seqs = [e["seq"] for e in events]
        assert seqs == sorted(seqs), "events in a frame must be in seq order"
        with self._lock:
            for e in events:
                seq = e["seq"]
                self.received.append(seq)
                if seq <= self.durable:
                    continue  # a resend
                expected = self.durable + 1
                declared = (  # a gap may jump over the seqs it declares lost
                    e["type"] == "gap"
                    and e["first_seq_lost"] <= expected
                    and e["last_seq_lost"] >= seq - 1
                )
                if seq != expected and not declared:
                    return {"type": "error", "code": "seq_gap", "expected": expected}
                self.stored[seq] = e
                self.durable = seq
        return None

    # --- test helpers -----------------------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        assert self._loop is not None and self._conn is not None
        fut = asyncio.run_coroutine_threadsafe(self._conn.send(json.dumps(msg)), self._loop)
        fut.result(WAIT_S)

    def wait_reply(self, cid: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while cid not in self.replies:
            assert time.monotonic() < deadline, f"no control_ack for {cid}"
            time.sleep(0.01)
        return self.replies[cid]


def wait_until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hello_fields() -> dict[str, Any]:
    return {
        "model": "tiny",
        "host": "h",
        "pid": 1,
        "policy": "chunked",
        "token_budget": 64,
        "max_token_budget": 512,
        "kv_blocks_total": 128,
        "block_size": 16,
        "config": {"model": "tiny"},
        "clock": {"wall_ns": 1_700_000_000_000_000_000, "mono_ns": 5},
    }


def make_publisher(url: str, **kw: Any) -> Publisher:
    kw.setdefault("backoff_initial_s", 0.02)
    kw.setdefault("backoff_max_s", 0.2)
    kw.setdefault("linger_s", 0.01)
    return Publisher(url, engine_id="eng-1", hello=hello_fields, **kw)


def req_event(i: int) -> RequestEvent:
    return RequestEvent(kind="arrived", request_id=f"r{i}", time_ns=1000 + i, traffic_class="chat")


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    c = FakeCollector().start()
    yield c
    c.stop()


def stored_seqs(c: FakeCollector) -> list[int]:
    return sorted(c.stored)


# --- tests --------------------------------------------------------------------------------------
def test_seq_continuity_batching_and_frame_bound(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url, max_batch_events=64, max_frame_bytes=4096).start()
    try:
        for i in range(1000):
            pub.publish(req_event(i))
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 1001))
        assert [collector.stored[s]["request_id"] for s in (1, 500, 1000)] == ["r0", "r499", "r999"]
        assert len(collector.frames) < 1000 // 4  # batched
        assert all(len(f["events"]) <= 64 for f in collector.frames)
        assert max(collector.raw_sizes) <= 4096
        hello = collector.hellos[0]
        assert hello["engine_id"] == "eng-1" and hello["run_id"] == pub.run_id
        assert hello["run_id"].startswith("run-") and hello["clock"]["mono_ns"] == 5
        assert hello["kv_blocks_total"] == 128 and "token" not in hello
        stats = pub.stats()
        assert stats.connected and stats.acked_seq == 1000 and stats.queued == 0
    finally:
        pub.close(timeout=WAIT_S)


def test_events_from_many_threads_each_stored_once(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url).start()
    try:
        threads = [
            threading.Thread(target=lambda k=k: [pub.publish(req_event(k * 1000 + i))
                                                 for i in range(300)])
            for k in range(4)
        ]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 1201))
        assert len({e["request_id"] for e in collector.stored.values()}) == 1200
    finally:
        pub.close(timeout=WAIT_S)


def test_serves_without_a_collector_and_publishes_once_one_appears() -> None:
    port = free_port()
    pub = make_publisher(f"ws://127.0.0.1:{port}").start()  # no path: /ingest is appended
    collector = FakeCollector(port)
    try:
        for i in range(50):
            pub.publish(req_event(i))
        wait_until(lambda: pub.stats().connect_failures >= 2, "a few failed connects")
        assert not pub.connected and pub.stats().queued == 50
        collector.start()
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 51))
    finally:
        pub.close(timeout=WAIT_S)
        collector.stop()


def test_resend_after_the_collector_drops_the_connection(collector: FakeCollector) -> None:
    collector.close_after_frames = 3
    pub = make_publisher(collector.url, max_batch_events=10).start()
    try:
        for i in range(200):
            pub.publish(req_event(i))
            if i % 10 == 0:
                time.sleep(0.005)
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 201))
        assert len(collector.hellos) == 2 and pub.stats().reconnects == 1
        assert collector.hellos[0]["run_id"] == collector.hellos[1]["run_id"]
        assert len(collector.received) > 200  # the unacknowledged frame was sent again
    finally:
        pub.close(timeout=WAIT_S)


def test_seq_gap_error_makes_the_publisher_resend(collector: FakeCollector) -> None:
    collector.refuse_first_frame = True
    pub = make_publisher(collector.url).start()
    try:
        for i in range(20):
            pub.publish(req_event(i))
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 21))
        assert len(collector.hellos) == 1  # recovered on the same connection
    finally:
        pub.close(timeout=WAIT_S)


def test_spill_file_used_past_the_memory_bound(tmp_path: Path) -> None:
    port = free_port()
    limits = BufferLimits(max_memory_events=10, spill_dir=tmp_path, spill_segment_bytes=1000)
    pub = make_publisher(f"ws://127.0.0.1:{port}/ingest", limits=limits).start()
    collector = FakeCollector(port)
    try:
        for i in range(100):
            pub.publish(req_event(i))
        stats = pub.stats()
        assert (stats.memory_events, stats.spill_events, stats.dropped_total) == (10, 90, 0)
        spill = tmp_path / pub.run_id
        assert len(list(spill.glob("*.jsonl"))) > 1
        collector.start()
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 101))
        assert [collector.stored[s]["request_id"] for s in range(1, 101)] == [
            f"r{i}" for i in range(100)
        ]
        assert list(spill.glob("*.jsonl")) == []  # deleted once acknowledged
    finally:
        pub.close(timeout=WAIT_S)
        collector.stop()
    assert not (tmp_path / pub.run_id).exists()


def test_gap_event_when_even_the_spill_limit_is_reached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    limits = BufferLimits(max_memory_events=5, max_spill_bytes=1000, spill_dir=tmp_path)
    pub = make_publisher(f"ws://127.0.0.1:{port}", limits=limits).start()
    collector = FakeCollector(port)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.telemetry"):
            for i in range(100):
                pub.publish(req_event(i))
        stats = pub.stats()
        kept = stats.queued
        assert stats.dropped_total == 100 - kept > 0 and stats.last_seq == 100
        assert "dropping new events" in caplog.text
        collector.start()
        assert pub.wait_acked(timeout=WAIT_S)
        pub.publish(req_event(100))
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == [*range(1, kept + 1), 101, 102]
        gap = collector.stored[101]
        assert gap["type"] == "gap"
        assert (gap["first_seq_lost"], gap["last_seq_lost"]) == (kept + 1, 100)
        assert gap["num_events_lost"] == 100 - kept
        assert collector.stored[102]["request_id"] == "r100"
        assert pub.stats().gaps_total == 1
        assert "declared them in gap event seq 101" in caplog.text
    finally:
        pub.close(timeout=WAIT_S)
        collector.stop()


def test_unknown_fields_and_messages_from_the_collector_are_tolerated() -> None:
    collector = FakeCollector(extra_fields=True).start()
    pub = make_publisher(collector.url).start()
    try:
        pub.publish(req_event(0))
        assert pub.wait_acked(timeout=WAIT_S)
        collector.send({"type": "notice", "text": "from a newer collector", "x": 1})
        pub.publish({"type": "request", "kind": "arrived", "request_id": "x", "time_ns": 1,
                     "from_the_future": [1, 2]})  # fmt: skip
        assert pub.wait_acked(timeout=WAIT_S)
        assert collector.stored[2]["from_the_future"] == [1, 2]
        assert len(collector.hellos) == 1 and pub.connected
    finally:
        pub.close(timeout=WAIT_S)
        collector.stop()


def test_close_flushes_and_sends_goodbye_last(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url, linger_s=0.2).start()
    for i in range(30):
        pub.publish(req_event(i))
    pub.close(timeout=WAIT_S)
    assert stored_seqs(collector) == list(range(1, 32))
    assert collector.stored[31]["type"] == "goodbye"
    pub.publish(req_event(99))  # after close: ignored
    assert pub.stats().last_seq == 31


def test_close_without_a_collector_is_bounded() -> None:
    pub = make_publisher(f"ws://127.0.0.1:{free_port()}").start()
    pub.publish(req_event(0))
    pub.close(timeout=0.5)
    assert not pub.connected


# --- control relay ------------------------------------------------------------------------------
class FakeEngine:
    def __init__(self) -> None:
        self.budget = 64
        self.calls: list[tuple[dict[str, Any], str | None]] = []

    async def apply(self, changes: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        self.calls.append((changes, request_id))
        value = changes.get("token_budget")
        if set(changes) != {"token_budget"}:
            raise ControlRefused(f"unknown scheduler key {next(iter(changes))!r}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 512:
            raise ControlRefused(f"token_budget must be from 1 to 512, got {value!r}")
        await asyncio.sleep(0.01)
        old, self.budget = self.budget, value
        return {"applied_at_step": 7, "old": {"token_budget": old}, "new": {"token_budget": value}}


def test_control_is_applied_and_acknowledged(collector: FakeCollector) -> None:
    engine = FakeEngine()
    pub = make_publisher(collector.url, apply_control=engine.apply).start()
    try:
        wait_until(lambda: pub.connected, "connected")
        collector.send({"type": "control", "id": "c1", "set": {"token_budget": 32}})
        reply = collector.wait_reply("c1")
        assert reply == {
            "type": "control_ack", "id": "c1", "ok": True, "applied_at_step": 7,
            "old": {"token_budget": 64}, "new": {"token_budget": 32},
        }  # fmt: skip
        assert engine.calls == [({"token_budget": 32}, "c1")]
        for cid, changes in (("c2", {"token_budget": 0}), ("c3", {"token_budget": "abc"}),
                             ("c4", {"nope": 1}), ("c5", "not an object")):  # fmt: skip
            collector.send({"type": "control", "id": cid, "set": changes})
            reply = collector.wait_reply(cid)
            assert reply["ok"] is False and reply["error"], reply
        assert engine.budget == 32
        assert "from 1 to 512" in collector.replies["c2"]["error"]
        assert pub.wait_acked(timeout=WAIT_S)
        refusals = [e for e in collector.stored.values() if e["type"] == "control"]
        assert [(e["request_id"], e["key"], e["new_value"], e["accepted"]) for e in refusals] == [
            ("c2", "token_budget", 0, False),
            ("c3", "token_budget", "abc", False),
            ("c4", "nope", 1, False),
        ]
        assert all(e["reason"] and e["source"] == "collector" for e in refusals)
    finally:
        pub.close(timeout=WAIT_S)


def test_control_needs_the_engine_control_token(collector: FakeCollector) -> None:
    engine = FakeEngine()
    pub = make_publisher(collector.url, apply_control=engine.apply, control_token="s3cret")
    pub.start()
    try:
        wait_until(lambda: pub.connected, "connected")
        collector.send({"type": "control", "id": "c1", "set": {"token_budget": 32}})
        collector.send({"type": "control", "id": "c2", "set": {"token_budget": 32},
                        "token": "wrong"})  # fmt: skip
        for cid in ("c1", "c2"):
            reply = collector.wait_reply(cid)
            assert reply["ok"] is False and "control token" in reply["error"]
        assert engine.calls == [] and engine.budget == 64
        collector.send({"type": "control", "id": "c3", "set": {"token_budget": 32},
                        "token": "s3cret"})  # fmt: skip
        assert collector.wait_reply("c3")["ok"] is True and engine.budget == 32
        assert pub.wait_acked(timeout=WAIT_S)
        refusals = [e for e in collector.stored.values() if e["type"] == "control"]
        assert [(e["request_id"], e["accepted"], e["source"]) for e in refusals] == [
            ("c1", False, "collector"),
            ("c2", False, "collector"),
        ]
    finally:
        pub.close(timeout=WAIT_S)


def test_control_made_with_the_token_is_taken_as_a_mac_bound_to_the_run(
    collector: FakeCollector,
) -> None:
    """A collector relays a MAC of the control under the token, never the token; the MAC holds
    only for this engine, run and control id."""
    engine = FakeEngine()
    pub = make_publisher(collector.url, apply_control=engine.apply, control_token="s3cret")
    pub.start()
    try:
        wait_until(lambda: pub.connected, "connected")
        hello = collector.hellos[-1]
        secret = hello["run_secret"]
        assert isinstance(secret, str) and len(secret) >= 32
        change = {"token_budget": 32}

        def mac(cid: str, **kw: Any) -> str:
            ids = {"engine_id": pub.engine_id, "run_id": pub.run_id, **kw}
            return control_mac("s3cret", control_id=cid, changes=change, **ids)

        forged = [
            ("m1", mac("m1", run_id="run-other")),  # made for another run
            ("m2", mac("other-id")),  # replayed under another id
            ("m3", control_mac("wrong", control_id="m3", engine_id=pub.engine_id,
                               run_id=pub.run_id, changes=change)),
        ]  # fmt: skip
        for cid, m in forged:
            collector.send({"type": "control", "id": cid, "set": change, "mac": m})
            assert collector.wait_reply(cid)["ok"] is False
        assert engine.calls == [] and engine.budget == 64
        collector.send({"type": "control", "id": "m4", "set": change, "mac": mac("m4")})
        assert collector.wait_reply("m4")["ok"] is True and engine.budget == 32
        pub2 = make_publisher(collector.url)
        assert pub2.run_secret != pub.run_secret  # one secret per run
    finally:
        pub.close(timeout=WAIT_S)


def test_control_without_an_apply_function_is_refused(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url).start()
    try:
        wait_until(lambda: pub.connected, "connected")
        collector.send({"type": "control", "id": "c1", "set": {"token_budget": 32}})
        assert "does not accept control" in collector.wait_reply("c1")["error"]
    finally:
        pub.close(timeout=WAIT_S)


def test_engine_control_events_pass_through_unchanged(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url).start()
    try:
        ev = ControlEvent(
            key="token_budget", old_value=64, new_value=32, accepted=True, time_ns=5,
            source="collector", applied_at_step=3, request_id="c9",
        )  # fmt: skip
        pub.publish(ev)
        assert pub.wait_acked(timeout=WAIT_S)
        assert collector.stored[1] == {**ev.to_dict(), "seq": 1}
    finally:
        pub.close(timeout=WAIT_S)


# --- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("ws://127.0.0.1:8765", "ws://127.0.0.1:8765/ingest"),
        ("ws://127.0.0.1:8765/", "ws://127.0.0.1:8765/ingest"),
        ("ws://127.0.0.1:8765/ingest", "ws://127.0.0.1:8765/ingest"),
        ("wss://collector.example:443/x/ingest", "wss://collector.example:443/x/ingest"),
    ],
)
def test_collector_url_gets_ingest_path(url: str, want: str) -> None:
    assert normalize_collector_url(url) == want


@pytest.mark.parametrize("url", ["http://127.0.0.1:8765", "127.0.0.1:8765", "", "ws://"])
def test_bad_collector_url_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="ws://"):
        normalize_collector_url(url)


def test_bad_publisher_settings_are_value_errors() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        Publisher("ws://127.0.0.1:1", engine_id="", hello=hello_fields)
    with pytest.raises(ValueError, match="max_batch_events"):
        Publisher("ws://127.0.0.1:1", engine_id="e", hello=hello_fields, max_batch_events=0)


class _Unencodable:
    def to_dict(self) -> dict[str, Any]:
        raise RuntimeError("broken event")


def test_an_event_that_cannot_be_encoded_keeps_its_seq(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url).start()
    try:
        pub.publish(req_event(0))
        pub.publish(_Unencodable())
        pub.publish(req_event(2))
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == [1, 2, 3]
        assert collector.stored[2]["type"] == "unencodable"
        assert "broken event" in collector.stored[2]["reason"]
        with pytest.raises(ValueError, match="type"):
            pub.publish({"kind": "arrived"})
    finally:
        pub.close(timeout=WAIT_S)


def test_a_steady_stream_does_not_wake_the_publisher_and_an_idle_one_does_not_poll(
    collector: FakeCollector,
) -> None:
    """While events keep coming the network thread polls every ``linger_s`` (``publish`` only
    appends: no call into its loop per frame); once idle it sleeps until the next publish."""
    pub = make_publisher(collector.url, linger_s=0.05)
    wakes: list[int] = []
    pub.buffer.on_data = lambda: (wakes.append(1), pub._wake_sender())
    takes: list[int] = []
    take = pub.buffer.take
    pub.buffer.take = lambda *a, **k: (takes.append(1), take(*a, **k))[1]  # type: ignore[method-assign]
    pub.start()
    try:
        for i in range(200):
            pub.publish(req_event(i))
            time.sleep(0.002)
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == list(range(1, 201))
        assert [collector.stored[s]["request_id"] for s in (1, 200)] == ["r0", "r199"]
        frames = len(collector.frames)
        assert frames < 200 // 4  # batched
        assert len(wakes) < frames / 2  # woken per frame (the old way): wakes == frames
        time.sleep(0.1)
        n_takes = len(takes)
        time.sleep(0.3)  # idle: no polling (6 polls at linger 0.05)
        assert len(takes) == n_takes
        pub.publish(req_event(200))  # the first event after an idle spell wakes it
        assert pub.wait_acked(timeout=WAIT_S) and len(wakes) >= 1
    finally:
        pub.close(timeout=WAIT_S)


def test_without_linger_publish_wakes_the_sender(collector: FakeCollector) -> None:
    pub = make_publisher(collector.url, linger_s=0)
    wakes: list[int] = []
    wake = pub._wake_sender
    pub.buffer.on_data = lambda: (wakes.append(1), wake())
    pub.start()
    try:
        assert pub.wait_acked(timeout=WAIT_S)
        time.sleep(0.05)  # the sender is idle and armed
        pub.publish(req_event(1))
        assert pub.wait_acked(timeout=WAIT_S)
        assert stored_seqs(collector) == [1] and wakes
    finally:
        pub.close(timeout=WAIT_S)
