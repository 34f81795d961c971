from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.serve import ServerHandle


@pytest.fixture
def make_engine() -> Callable[..., LLMEngine]:
    def make(**kw: object) -> LLMEngine:
        kw.setdefault("model", "tiny")
        kw.setdefault("device", "cpu")
        return LLMEngine(EngineConfig(**kw))  # type: ignore[arg-type]

    return make


# Server tests define a module-scoped ``server`` fixture (in-thread or process mode); these
# clients talk to whichever one the requesting module started.
@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c
