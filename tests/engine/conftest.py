from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture
def make_engine() -> Callable[..., LLMEngine]:
    def make(**kw: object) -> LLMEngine:
        kw.setdefault("model", "tiny")
        kw.setdefault("device", "cpu")
        return LLMEngine(EngineConfig(**kw))  # type: ignore[arg-type]

    return make
