"""``StreamRouter``: registration and failure are atomic, so no request waits forever."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.process.errors import APIError
from engine.process.streams import ADMITTED, RequestFailed, RequestRefused, StreamRouter


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
        router.dispatch([Out("a", False)])  # a finished: nothing more reaches it
        await asyncio.sleep(0)
        assert q.empty()

    asyncio.run(run())
