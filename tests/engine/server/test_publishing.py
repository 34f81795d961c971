"""The engine's hello (``engine.server.publishing.engine_hello``): what the collector and the
autopilot learn about the engine at connect."""

from __future__ import annotations

from types import SimpleNamespace

from engine.core.config import EngineConfig
from engine.core.outputs import EngineStats
from engine.server.publishing import engine_hello
from wire.events import ClockAnchor


def test_the_hello_carries_the_max_model_len_in_force() -> None:
    # the config leaves it to the model (None); the engine resolved it (the model's own, up to
    # 32k): the autopilot's probe and the advisor's shape need the resolved number
    client = SimpleNamespace(
        config=EngineConfig(model="demo", max_model_len=None),
        max_model_len=32768,
        mode="process",
        policy="chunked",
        token_budget=2048,
        long_prefill_token_threshold=0,
        max_token_budget=16384,
        pid=123,
        stats=lambda: EngineStats(0, 0, 0, 4096, 0, 2048, "chunked"),
    )
    hello = engine_hello(client, "demo", ClockAnchor(0, 0))  # type: ignore[arg-type]
    assert hello["config"]["max_model_len"] == 32768
    assert hello["config"]["model"] == "demo" and hello["token_budget"] == 2048
