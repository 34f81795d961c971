"""Shared fixtures: a mock OpenAI-compatible server on 127.0.0.1:0 in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from loadgen.mockserver import SEEN, MockConfig, make_app


@dataclass
class MockServer:
    url: str
    seen: list[dict[str, Any]]
    cfg: MockConfig


def _start(
    app: web.Application,
) -> tuple[str, asyncio.AbstractEventLoop, threading.Thread, web.AppRunner]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def up() -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(up())
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10), "mock server did not start"
    return f"http://127.0.0.1:{box['port']}", loop, t, box["runner"]


@pytest.fixture
def mock_server() -> Iterator[MockServer]:
    cfg = MockConfig(ttft_ms=2.0, interval_ms=2.0, max_model_len=4096)
    app = make_app(cfg)
    url, loop, thread, runner = _start(app)
    try:
        yield MockServer(url, app[SEEN], cfg)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def raw_server() -> Iterator[Any]:
    """Factory: serve an arbitrary aiohttp handler on POST /v1/completions; returns its URL."""
    started: list[tuple[asyncio.AbstractEventLoop, threading.Thread, web.AppRunner]] = []

    def factory(handler: Any) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        url, loop, thread, runner = _start(app)
        started.append((loop, thread, runner))
        return url

    yield factory
    for loop, thread, runner in started:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
