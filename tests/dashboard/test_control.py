"""The control client against a small fake collector, and the UI-side validation."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from dashboard import control
from storage.control import CollectorUnavailable, control_url


class FakeCollector:
    """``/control`` only: answers list_engines and control like docs/telemetry.md says."""

    def __init__(self, *, silent: bool = False) -> None:
        self.silent = silent
        self.received: list[dict[str, Any]] = []
        self.authorization: list[str | None] = []
        self.budget = 2048
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Future[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None and ws.request.path.partition("?")[0] == "/control"
        self.authorization.append(ws.request.headers.get("Authorization"))
        async for raw in ws:
            msg = json.loads(raw)
            self.received.append(msg)
            if self.silent:
                continue
            if msg["type"] == "list_engines":
                engines = [
                    {"engine_id": "e1", "run_id": "r1", "connected": True, "model": "tiny",
                     "token_budget": self.budget, "max_token_budget": 8192, "policy": "chunked",
                     "last_step": 41, "last_seen_ns": 1},
                ]  # fmt: skip
                await ws.send(json.dumps({"type": "engines", "engines": engines}))
            elif msg["type"] == "control":
                await ws.send(json.dumps({"type": "unrelated"}))  # ignored by the client
                n = msg["set"].get("token_budget")
                if msg["engine_id"] != "e1":
                    ack = {"ok": False, "error": f"unknown engine {msg['engine_id']}"}
                elif n is not None and not 1 <= n <= 8192:
                    ack = {"ok": False, "error": f"token_budget must be from 1 to 8192, got {n}"}
                else:
                    old, self.budget = self.budget, n or self.budget
                    ack = {"ok": True, "applied_at_step": 42, "old": {"token_budget": old},
                           "new": {"token_budget": self.budget}}  # fmt: skip
                await ws.send(json.dumps({"type": "control_ack", "id": msg["id"], **ack}))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = self._loop.create_future()
            async with serve(self._handler, "127.0.0.1", 0) as server:
                self.port = server.sockets[0].getsockname()[1]
                self._ready.set()
                await self._stop

        self._loop.run_until_complete(main())

    def __enter__(self) -> FakeCollector:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


@pytest.fixture
def collector() -> Iterator[FakeCollector]:
    with FakeCollector() as c:
        yield c


def test_control_url_normalises_paths() -> None:
    assert control_url("ws://127.0.0.1:8765") == "ws://127.0.0.1:8765/control"
    assert control_url("ws://h:1/ingest") == "ws://h:1/control"
    with pytest.raises(ValueError, match="ws://HOST:PORT"):
        control_url("http://h:1")


def test_list_engines(collector: FakeCollector) -> None:
    engines = control.list_engines(collector.url)
    assert [e["engine_id"] for e in engines] == ["e1"]
    assert engines[0]["token_budget"] == 2048


def test_set_budget_applied_and_refused(collector: FakeCollector) -> None:
    res = control.set_scheduler(collector.url, "e1", token_budget=256)
    assert res.ok and res.applied_at_step == 42
    assert res.describe() == "applied at step 42 (token_budget 2048 → 256)"
    sent = collector.received[-1]
    assert sent["type"] == "control" and sent["set"] == {"token_budget": 256}
    assert sent["id"] == res.id and "token" not in sent

    res = control.set_scheduler(collector.url, "nope", token_budget=256)
    assert not res.ok and res.describe() == "refused: unknown engine nope"


def test_control_token_is_sent_when_given(collector: FakeCollector) -> None:
    control.set_scheduler(collector.url, "e1", policy="unchunked", token="s3cret")
    # presented when connecting (it opens /control), in a header: not in the message or URL
    assert collector.authorization[-1] == "Bearer s3cret"
    assert "token" not in collector.received[-1]
    assert collector.received[-1]["set"] == {"policy": "unchunked"}


def test_nothing_to_change_is_refused_before_sending(collector: FakeCollector) -> None:
    with pytest.raises(ValueError, match="nothing to change"):
        control.set_scheduler(collector.url, "e1")
    assert collector.received == []


def test_down_collector_is_collector_unavailable() -> None:
    with FakeCollector() as c:
        url = c.url
    with pytest.raises(CollectorUnavailable, match="unreachable"):
        control.list_engines(url, timeout=2)


def test_silent_collector_times_out() -> None:
    with FakeCollector(silent=True) as c:
        with pytest.raises(CollectorUnavailable, match="no answer"):
            control.set_scheduler(c.url, "e1", token_budget=5, timeout=0.5)


def test_client_works_inside_a_running_event_loop(collector: FakeCollector) -> None:
    async def inner() -> list[dict[str, Any]]:
        return control.list_engines(collector.url)

    assert asyncio.run(inner())[0]["engine_id"] == "e1"


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1), (512, 512), ("256", 256), (" 64 ", 64), (128.0, 128), (8192, 8192)],
)
def test_validate_budget_accepts(value: object, expected: int) -> None:
    assert control.validate_budget(value, 8192) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("abc", "whole number, got 'abc'"),
        ("", "whole number"),
        (12.5, "whole number, got 12.5"),
        (True, "whole number"),
        (None, "whole number"),
        (0, "from 1 to 8192, got 0"),
        (-5, "from 1 to 8192, got -5"),
        (8193, "from 1 to 8192, got 8193"),
        (10**9, "from 1 to 8192"),
    ],
)
def test_validate_budget_refuses_with_reason(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        control.validate_budget(value, 8192)


def test_validate_budget_without_known_maximum() -> None:
    assert control.validate_budget(10**6, None) == 10**6
    with pytest.raises(ValueError, match="from 1 or more"):
        control.validate_budget(0, None)


def test_validate_policy() -> None:
    assert control.validate_policy("unchunked") == "unchunked"
    with pytest.raises(ValueError, match="chunked, unchunked"):
        control.validate_policy("fifo")


@pytest.mark.parametrize(
    ("value", "expected"), [(0, 0), ("0", 0), (0.0, 0), (256, 256), (" 64 ", 64), (8192, 8192)]
)
def test_validate_cap_accepts_zero_and_budgets(value: object, expected: int) -> None:
    assert control.validate_cap(value, 8192) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (-1, "long-prefill cap must be from 0 to 8192, got -1"),
        (8193, "long-prefill cap must be from 0 to 8192, got 8193"),
        (True, "long-prefill cap must be a whole number"),
        ("x", "long-prefill cap must be a whole number, got 'x'"),
        (2.5, "whole number, got 2.5"),
    ],
)
def test_validate_cap_refuses_like_the_budget(value: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        control.validate_cap(value, 8192)


def test_set_cap_sends_the_cap_key(collector: FakeCollector) -> None:
    control.set_scheduler(collector.url, "e1", long_prefill_token_threshold=256)
    assert collector.received[-1]["set"] == {"long_prefill_token_threshold": 256}
