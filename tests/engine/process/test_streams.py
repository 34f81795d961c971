"""``StreamRouter``: registration and failure are atomic, so no request waits forever."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.process.errors import APIError
from engine.process.streams import (
    ADMITTED,
    OBSERVED,
    RequestFailed,
    RequestRefused,
    StreamRouter,
)


def test_open_after_close_is_engine_dead() -> None:
    """The race of issue 7: a request that checked 'alive' and registered only after the core
    died (and the table of streams was failed) was never failed. Now opening a stream on a
    closed router is the engine_dead 503, whatever came first."""
    router = StreamRouter()

    async def run() -> None:
        router.close("the engine core process died")
        with pytest.raises(APIError) as info:
            router.open("late")
        assert info.value.status == 503 and info.value.code == "engine_dead"
        assert "died" in info.value.message

    asyncio.run(run())


def _race_once() -> tuple[int, int]:
    router = StreamRouter()
    go = threading.Event()

    def closer() -> None:
        go.wait(5)
        router.close("died")

    async def run() -> tuple[int, int]:
        queues, refused = [], 0
        for i in range(200):
            if i == 5:
                go.set()
            try:
                queues.append(router.open(f"r{i}"))
            except APIError:
                refused += 1
            await asyncio.sleep(0)
        answered = 0
        for q in queues:
            item = await asyncio.wait_for(q.get(), 5)
            answered += isinstance(item, RequestFailed)
        return answered, refused

    t = threading.Thread(target=closer)
    t.start()
    result = asyncio.run(run())
    t.join(5)
    return result


def test_close_racing_opens_fails_or_refuses_every_request() -> None:
    """Opens on the event loop while another thread closes: every stream is either refused at
    open or receives the failure; none is left without an answer."""
    for _ in range(20):
        answered, refused = _race_once()
        assert answered + refused == 200


def test_admission_then_outputs_in_order() -> None:
    class Out:
        def __init__(self, rid: str, finished: bool) -> None:
            self.request_id, self.finished = rid, finished

    router = StreamRouter()

    async def run() -> None:
        q = router.open("a")
        refused = router.open("b")
        router.admit("a", None)
        router.admit("b", RequestRefused("queue_full", "full"))
        router.dispatch([Out("a", False), Out("b", False), Out("a", True)])
        items = [await asyncio.wait_for(q.get(), 5) for _ in range(3)]
        assert items[0] is ADMITTED and [o.finished for o in items[1:]] == [False, True]
        only = await asyncio.wait_for(refused.get(), 5)
        assert isinstance(only, RequestRefused) and only.kind == "queue_full"
        assert refused.empty()  # the refusal ended b's stream: its outputs are dropped
        router.observed(["a"])  # the listeners saw the step that finished a: its stream ends
        assert await asyncio.wait_for(q.get(), 5) is OBSERVED
        router.dispatch([Out("a", False)])  # nothing more reaches it
        await asyncio.sleep(0)
        assert q.empty()

    asyncio.run(run())


class _Out:
    def __init__(self, rid: str) -> None:
        self.request_id, self.finished = rid, False


def _loop_in_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    return loop, t


def test_dispatch_with_wait_returns_once_every_woken_handler_has_run() -> None:
    """The engine client's reader dispatches a step's tokens and waits for the handlers to run
    before it runs the step's listeners (which would hold the GIL the event loop needs to send
    the tokens). When dispatch returns, every consumer has taken its token and written it."""
    router = StreamRouter()
    loop, t = _loop_in_thread()
    written: list[str] = []
    ready = threading.Event()

    async def handler(rid: str) -> None:
        q = router.open(rid)
        if rid == "r4":
            ready.set()
        for _ in range(20):
            out = await q.get()
            written.append(out.request_id)  # the handler's write of its chunk

    try:
        for i in range(5):
            asyncio.run_coroutine_threadsafe(handler(f"r{i}"), loop)
        assert ready.wait(5)
        time.sleep(0.05)  # every handler waits on its queue
        for step in range(20):
            assert router.dispatch([_Out(f"r{i}") for i in range(5)], wait_s=5.0)
            assert len(written) == 5 * (step + 1)  # no token still waiting for its handler
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


def test_dispatch_gives_up_waiting_on_a_busy_loop() -> None:
    """A loop busy elsewhere holds the reader back at most ``wait_s``; the tokens are still
    delivered when the loop gets to them."""
    router = StreamRouter()
    loop, t = _loop_in_thread()
    got: list[object] = []

    async def handler() -> None:
        got.append(await router.open("a").get())

    try:
        asyncio.run_coroutine_threadsafe(handler(), loop)
        time.sleep(0.05)
        loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop blocked for a while
        time.sleep(0.01)
        t0 = time.monotonic()
        assert router.dispatch([_Out("a")], wait_s=0.05) is False
        assert time.monotonic() - t0 < 0.45  # bounded by wait_s, not by the busy loop
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(got) == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
