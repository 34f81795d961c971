"""A step's tokens go to their streams, and their handlers take them, before the step's
listeners (telemetry, metrics) run, so no observer's work delays a token, the last one included;
a finished request's stream ends (``OBSERVED``) only after them, so once a response has ended
every event of its request has been observed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.process.client import EngineClient
from engine.process.streams import ADMITTED, OBSERVED
from wire.events import StepEvent


def test_tokens_reach_their_streams_before_the_listeners_see_the_step(
    make_engine: Callable[..., LLMEngine],
) -> None:
    client = EngineClient.in_thread(make_engine())
    order: list[tuple[str, Any]] = []
    dispatch = client.streams.dispatch

    def recording_dispatch(outputs: list[Any], wait_s: float = 0.0) -> bool:
        order.append(("tokens", tuple(o.finished for o in outputs)))
        return dispatch(outputs, wait_s=wait_s)

    client.streams.dispatch = recording_dispatch  # type: ignore[method-assign]
    client.add_listener(
        lambda ev: order.append(("step", ev.step)) if isinstance(ev, StepEvent) else None
    )

    async def run() -> int:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        _, queue = client.submit([1, 5, 6, 7], params)
        assert await asyncio.wait_for(queue.get(), 30) is ADMITTED
        n = 0
        while True:  # as the server's handlers do: the queue awaited directly
            out = await queue.get()
            order.append(("taken", out.finished))
            n += len(out.new_token_ids)
            if out.finished:
                assert await queue.get() is OBSERVED
                order.append(("observed", None))
                return n

    try:
        assert asyncio.run(asyncio.wait_for(run(), 60)) == 4
    finally:
        client.shutdown()
    steps = [i for i, (kind, _) in enumerate(order) if kind == "step"]
    tokens = [i for i, (kind, _) in enumerate(order) if kind == "tokens"]
    taken = [i for i, (kind, _) in enumerate(order) if kind == "taken"]
    assert len(steps) == 4 and len(tokens) == 4 and len(taken) == 4, order
    # every step, the last too: the tokens first, taken by their handler, then the step's event
    for tok, took, step in zip(tokens, taken, steps, strict=True):
        assert tok < took < step, order
    assert [order[t][1] for t in tokens] == [(False,), (False,), (False,), (True,)], order
    # and the stream ends after the last step's event
    assert order[-1] == ("observed", None) and steps[3] < len(order) - 1, order
