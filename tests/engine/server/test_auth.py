"""The engine's credentials: ``--api-key`` on the /v1 routes as vLLM does it (health and metrics
open), the control token on ``PUT /v1/scheduler``, and the loopback rule of ``--host``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from engine.server import cli
from engine.server.serve import ServerHandle, serve_in_thread


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerHandle]:
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=256))
    handle = serve_in_thread(engine, api_keys=["key-1", "kéy-2"], control_token="steer-1")
    yield handle
    handle.stop()


def _get(handle: ServerHandle, path: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.get(handle.base_url + path, headers=headers, timeout=30)


def _put(handle: ServerHandle, token: str | None, budget: int = 64) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.put(
        handle.base_url + "/v1/scheduler",
        json={"token_budget": budget},
        headers=headers,
        timeout=30,
    )


@pytest.mark.parametrize("token", [None, "wrong", "key-1x", "steer-1"])
def test_the_v1_routes_need_an_api_key(keyed: ServerHandle, token: str | None) -> None:
    r = _get(keyed, "/v1/models", token)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "--api-key" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"


def test_any_of_the_keys_serves_and_health_and_metrics_stay_open(keyed: ServerHandle) -> None:
    assert _get(keyed, "/v1/models", "key-1").status_code == 200
    utf8 = {"Authorization": "Bearer kéy-2".encode()}  # non-ASCII keys: compared as bytes
    assert httpx.get(keyed.base_url + "/v1/models", headers=utf8).status_code == 200
    assert _get(keyed, "/health").status_code == 200
    assert _get(keyed, "/metrics").status_code == 200
    client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="key-1", max_retries=0)
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_steering_takes_the_control_token_not_the_api_key(keyed: ServerHandle) -> None:
    before = _get(keyed, "/v1/scheduler", "key-1").json()["token_budget"]
    for token in (None, "key-1", "steer-1x"):
        r = _put(keyed, token, before + 1)
        assert r.status_code == 401 and "--control-token" in r.json()["error"]["message"]
    assert _get(keyed, "/v1/scheduler", "key-1").json()["token_budget"] == before
    r = _put(keyed, "steer-1", before + 1)
    assert r.status_code == 200 and r.json()["token_budget"] == before + 1


def test_with_only_an_api_key_the_scheduler_is_not_left_open(
    make_engine: Callable[..., Any],
) -> None:
    handle = serve_in_thread(make_engine(max_model_len=256), api_keys=["only-key"])
    try:
        assert _put(handle, None).status_code == 401
        assert _put(handle, "only-key").status_code == 200
    finally:
        handle.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.org", ""])
def test_a_non_loopback_host_without_an_api_key_refuses_to_start(
    host: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CHUNKSCOPE_API_KEY", raising=False)
    assert cli.main(["--host", host, "--port", "0"]) == 2  # before any engine starts
    err = capsys.readouterr().err
    assert "--api-key" in err and "--allow-unauthenticated" in err and "docs/security.md" in err


def test_loopback_a_key_or_the_opt_out_may_bind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHUNKSCOPE_API_KEY", raising=False)
    parse = cli.build_parser().parse_args
    assert cli.bind_refusal(parse(["--host", "127.0.0.1"])) == ""
    assert cli.bind_refusal(parse(["--host", "localhost"])) == ""
    assert cli.bind_refusal(parse(["--host", "::1"])) == ""
    assert cli.bind_refusal(parse(["--host", "0.0.0.0", "--api-key", "k"])) == ""
    assert cli.bind_refusal(parse(["--host", "0.0.0.0", "--allow-unauthenticated"])) == ""
    assert cli.bind_refusal(parse(["--host", "0.0.0.0"]))
    monkeypatch.setenv("CHUNKSCOPE_API_KEY", "from-env")  # read like VLLM_API_KEY
    assert cli.bind_refusal(parse(["--host", "0.0.0.0"])) == ""
    assert cli._credentials(parse([]))[0] == ["from-env"]
    assert cli._credentials(parse(["--api-key", "a", "--api-key", "b"]))[0] == ["a", "b"]
