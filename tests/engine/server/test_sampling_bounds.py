"""Sampling parameters at the HTTP edge: out-of-range values are a 400 naming the field, and a
request that fails while it is served (here: its detokenisation) gets a typed error of its own
while the server goes on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server import generation
from engine.server.serve import ServerHandle, serve_in_thread


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=256))
    with serve_in_thread(engine) as handle:
        yield handle


def _expect_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _valid(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"stop_token_ids": [5, 10**6]}, "stop_token_ids"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_sampling_is_a_400(
    server: ServerHandle, http: httpx.Client, path: str, extra: dict, param: str
) -> None:
    base: dict[str, Any] = {"max_tokens": 2, "temperature": 0.7}
    if path == "/v1/completions":
        base["prompt"] = "x"
    else:
        base["messages"] = [{"role": "user", "content": "x"}]
    before = server.state.client.stats().step
    err = _expect_error(http.post(path, content=json.dumps({**base, **extra})), 400)
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert err["type"] == "invalid_request_error"
    assert server.state.client.stats().step == before
    _valid(http)


class _BrokenDetokenizer:
    def __init__(self, tokenizer: object) -> None:
        pass

    def add(self, ids: list[int]) -> str:
        raise UnicodeError("detokenizer broke")

    def flush(self) -> str:
        return ""


def test_a_failed_detokenisation_fails_that_request_alone(
    server: ServerHandle, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
    with monkeypatch.context() as m:
        m.setattr(generation, "IncrementalDetokenizer", _BrokenDetokenizer)
        err = _expect_error(http.post("/v1/completions", json=body), 500)
        assert err["code"] == "engine_error" and "detoken" in err["message"], err
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["error"]["code"] == "engine_error", last
    _valid(http)
