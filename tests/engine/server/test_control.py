"""``apply_scheduler_update``: the one implementation of a live scheduler change."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.control import apply_scheduler_update
from wire.control import ControlRefused, check_changes


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(model="tiny", device="cpu", max_model_len=256, token_budget=64,
                     max_token_budget=128)
    )  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"budget": 8}, "budget"),
        ({"token_budget": "8"}, "token_budget"),
        ({"token_budget": True}, "token_budget"),
        ({"token_budget": 0}, "token_budget"),
        ({"token_budget": 129}, "token_budget"),
        ({"policy": "fastest"}, "policy"),
        ({"token_budget": 32, "policy": "fastest"}, "policy"),  # a good and a bad value
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": 129}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": "8"}, "long_prefill_token_threshold"),
        ({"long_prefill_token_threshold": False}, "long_prefill_token_threshold"),
        ({}, None),
    ],
)
def test_refusals_change_nothing(engine: LLMEngine, changes: dict, param: str | None) -> None:
    before = (engine.token_budget, engine.policy, engine.long_prefill_token_threshold)
    with pytest.raises(ControlRefused) as info:
        asyncio.run(apply_scheduler_update(engine, changes, source="test"))
    assert info.value.param == param and isinstance(info.value, ValueError)
    assert len(info.value.reason) > 10
    assert (engine.token_budget, engine.policy, engine.long_prefill_token_threshold) == before


def test_cap_refusal_reads_like_the_budgets(engine: LLMEngine) -> None:
    refusals = []
    for key, bad in (("token_budget", 129), ("long_prefill_token_threshold", 129)):
        with pytest.raises(ControlRefused) as info:
            check_changes({key: bad}, 128)
        refusals.append(info.value.reason)
    assert refusals[0] == "token_budget must be from 1 to 128, got 129"
    assert refusals[1] == "long_prefill_token_threshold must be from 0 to 128, got 129"


def test_cap_applies_at_a_step_and_is_reported(engine: LLMEngine) -> None:
    key = "long_prefill_token_threshold"
    step = engine.scheduler.next_step
    change = asyncio.run(apply_scheduler_update(engine, {key: 32}, source="test"))
    assert change.applied_at_step == step and change.old == {key: 0} and change.new == {key: 32}
    [event] = change.events
    assert event.key == key and event.accepted and event.applied_at_step == step
    assert (
        engine.long_prefill_token_threshold == 32
        and engine.stats().long_prefill_token_threshold == 32
    )
    asyncio.run(apply_scheduler_update(engine, {key: 0}, source="test"))
    assert engine.long_prefill_token_threshold == 0


def test_applies_and_reports(engine: LLMEngine) -> None:
    step = engine.scheduler.next_step
    change = asyncio.run(
        apply_scheduler_update(engine, {"policy": "unchunked", "token_budget": 100}, source="test")
    )
    assert change.applied_at_step == step
    assert change.old == {"token_budget": 64, "policy": "chunked"}
    assert change.new == {"token_budget": 100, "policy": "unchunked"}
    assert [e.key for e in change.events] == ["token_budget", "policy"]
    assert all(e.accepted and e.source == "test" for e in change.events)
    assert (engine.token_budget, engine.policy) == (100, "unchunked")
    asyncio.run(apply_scheduler_update(engine, change.old, source="test"))
    assert (engine.token_budget, engine.policy) == (64, "chunked")


def test_callable_from_another_threads_loop(engine: LLMEngine) -> None:
    """The telemetry relay awaits it on its own event loop, on its own thread."""
    results: list[object] = []

    def relay() -> None:
        results.append(
            asyncio.run(apply_scheduler_update(engine, {"token_budget": 50}, source="collector"))
        )

    t = threading.Thread(target=relay)
    t.start()
    t.join(30)
    assert len(results) == 1 and results[0].new == {"token_budget": 50}  # type: ignore[attr-defined]
    assert check_changes({"policy": "chunked", "token_budget": 1}, 1) == {
        "token_budget": 1,
        "policy": "chunked",
    }
    asyncio.run(apply_scheduler_update(engine, {"token_budget": 64}, source="test"))
