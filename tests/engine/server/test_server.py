"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP.

The module's server runs as ``python -m engine`` does by default: the engine core in a child
process. Tests that patch the ``LLMEngine`` itself start a server of their own whose core runs
on a thread (the same core loop and client, over in-process queues).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.multimodal import encode_data_url, num_image_tokens
from engine.server.serve import ServerHandle, serve_in_thread
from tests.engine.server.serving_helpers import StepLog
from wire.events import RequestEvent

CONTROL_TOKEN = "s3cret"
MAX_MODEL_LEN = 512
MAX_BODY = 1 << 20
MAX_IMAGE_BYTES = 200_000


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    config = EngineConfig(model="tiny", device="cpu", max_model_len=MAX_MODEL_LEN, token_budget=256)
    handle = serve_in_thread(
        config,
        control_token=CONTROL_TOKEN,
        max_body_bytes=MAX_BODY,
        max_image_bytes=MAX_IMAGE_BYTES,
    )
    assert handle.state.client.mode == "process"
    log = StepLog()
    handle.state.client.add_listener(log)  # events arrive from the core, one batch per step
    handle.step_log = log  # type: ignore[attr-defined]
    yield handle
    handle.stop()


def _image_url(h: int, w: int, fmt: str = "PNG") -> str:
    pixels = np.random.default_rng(h * w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return encode_data_url(pixels, fmt)


def _wait_idle(server: ServerHandle, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.state.client.stats()
        idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


# --- through the official client ------------------------------------------------------------


def test_models_and_health(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["step_loop_alive"] is True
    assert health["engine_mode"] == "process"


def test_completion_exact_max_tokens(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len("hello world") + 1  # bytes + BOS
    assert out.usage.completion_tokens == 9
    ext = out.model_extra["chunkscope"]  # type: ignore[index]
    assert len(ext["token_times"]) == 9 and ext["arrival_time"] <= ext["first_scheduled_time"]


def test_completion_token_ids_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt=[256, 104, 105], max_tokens=3, temperature=0, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.usage is not None and out.usage.prompt_tokens == 3
    assert out.usage.completion_tokens == 3


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt="stream me",
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert len(content) == 7
    assert content[-1].choices[0].finish_reason == "length"
    usage_chunk = chunks[-1]
    assert not usage_chunk.choices and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 7
    assert usage_chunk.usage.prompt_tokens == len("stream me") + 1
    assert len(usage_chunk.model_extra["chunkscope"]["token_times"]) == 7  # type: ignore[index]


def test_chat_non_stream_and_stream(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert len(content) == 6 and content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_chat_with_image_counts_image_tokens(client: openai.OpenAI, fmt: str) -> None:
    text_only = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}]}]
    with_image = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": _image_url(100, 150, fmt)}},
            ],
        }
    ]
    base = client.chat.completions.create(model="tiny", messages=text_only, max_tokens=2)
    out = client.chat.completions.create(
        model="tiny", messages=with_image, max_tokens=3, extra_body={"ignore_eos": True}
    )
    expected = num_image_tokens(100, 150)
    assert expected == 20
    assert base.usage is not None and out.usage is not None
    assert out.usage.prompt_tokens == base.usage.prompt_tokens + expected
    assert out.usage.completion_tokens == 3
    assert out.model_extra["chunkscope"]["num_image_tokens"] == expected  # type: ignore[index]


def test_32_concurrent_streams(server: ServerHandle) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        n = 4 + i % 9
        stream = await client.completions.create(
            model="tiny",
            prompt=f"request number {i} " * (1 + i % 5),
            max_tokens=n,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        count, usage = 0, None
        async for chunk in stream:
            if chunk.choices:
                count += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return n, count, usage or -1

    async def run() -> list[tuple[int, int, int]]:
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="unused", max_retries=0
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert all(n == count == usage for n, count, usage in results), results


# --- scheduler control, metrics, disconnects ------------------------------------------------


def test_scheduler_put_applies_at_next_step(
    server: ServerHandle, http: httpx.Client, client: openai.OpenAI
) -> None:
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    before = http.get("/v1/scheduler").json()
    assert before["token_budget"] == 256 and before["policy"] == "chunked"
    r = http.put("/v1/scheduler", json={"token_budget": 48, "policy": "chunked"}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_budget"] == 48 and body["applied_at_step"] is not None
    assert [c["key"] for c in body["changes"]] == ["token_budget", "policy"]
    applied = body["applied_at_step"]
    client.completions.create(
        model="tiny", prompt="x" * 200, max_tokens=2, extra_body={"ignore_eos": True}
    )
    log: StepLog = server.step_log  # type: ignore[attr-defined]
    after = [e for e in log.steps if e.step >= applied]
    assert after and after[0].step == applied and after[0].token_budget == 48
    assert all(e.num_scheduled_tokens <= 48 for e in after)
    assert http.get("/v1/scheduler").json()["token_budget"] == 48
    # restore
    r = http.put("/v1/scheduler", json={"token_budget": 256}, headers=auth)
    assert r.status_code == 200


def test_scheduler_put_sets_the_cap_live(
    server: ServerHandle, http: httpx.Client, client: openai.OpenAI
) -> None:
    key = "long_prefill_token_threshold"
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    assert http.get("/v1/scheduler").json()[key] == 0
    bad = http.put("/v1/scheduler", json={key: 10**6}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == key
    r = http.put("/v1/scheduler", json={key: 16}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body[key] == 16 and [c["key"] for c in body["changes"]] == [key]
    applied = body["applied_at_step"]
    client.completions.create(
        model="tiny", prompt="y" * 300, max_tokens=2, extra_body={"ignore_eos": True}
    )
    log: StepLog = server.step_log  # type: ignore[attr-defined]
    after = [e for e in log.steps if e.step >= applied]
    assert after and all(e.long_prefill_token_threshold == 16 for e in after)
    assert http.get("/v1/scheduler").json()[key] == 16
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    [sample] = families["chunkscope:" + key].samples
    assert sample.value == 16
    assert http.put("/v1/scheduler", json={key: 0}, headers=auth).status_code == 200


def test_metrics_parse(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(
        model="tiny", prompt="metrics", max_tokens=4, extra_body={"ignore_eos": True},
        extra_headers={"X-Traffic-Class": "rag"},
    )  # fmt: skip
    r = http.get("/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in (
        "chunkscope:time_to_first_token_seconds",
        "chunkscope:inter_token_latency_seconds",
        "chunkscope:request_time_per_output_token_seconds",
        "chunkscope:e2e_request_latency_seconds",
        "chunkscope:request_queue_time_seconds",
        "chunkscope:num_requests_running",
        "chunkscope:num_requests_waiting",
        "chunkscope:kv_cache_usage_perc",
        "chunkscope:token_budget",
        "chunkscope:prompt_tokens",
        "chunkscope:generation_tokens",
        "chunkscope:num_preemptions",
        "chunkscope:steps",
        "chunkscope:tokens_per_step",
    ):
        assert name in families, name
    ttft = families["chunkscope:time_to_first_token_seconds"]
    classes = {s.labels.get("traffic_class") for s in ttft.samples}
    assert "rag" in classes
    gen = [s for s in families["chunkscope:generation_tokens"].samples if s.name.endswith("_total")]
    assert gen and gen[0].value > 0


def test_disconnect_frees_blocks(server: ServerHandle, http: httpx.Client) -> None:
    _wait_idle(server)
    body = {
        "model": "tiny",
        "prompt": "a long one " * 8,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 3:
                    break
            assert server.state.client.stats().kv_blocks_used > 0
    # the connection is closed now: the request must be aborted and its blocks freed
    deadline = time.monotonic() + 10
    usage = None
    while time.monotonic() < deadline:
        families = text_string_to_metric_families(http.get("/metrics").text)
        usage = next(
            s.value
            for f in families
            if f.name == "chunkscope:kv_cache_usage_perc"
            for s in f.samples
        )
        if usage == 0:
            break
        time.sleep(0.05)
    assert usage == 0
    stats = server.state.client.stats()
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_non_stream_disconnect_frees_blocks(server: ServerHandle, http: httpx.Client) -> None:
    """A client that leaves while its (non-streaming) request runs: the request is aborted,
    not run to max_tokens, and its blocks are freed."""
    _wait_idle(server)
    before = _finish_reasons(http)
    client = server.state.client
    body = json.dumps({"prompt": "patience " * 4, "max_tokens": 450, "ignore_eos": True})
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall((head + body).encode())
        assert _wait(lambda: client.stats().num_running == 1)  # it runs in the engine
    want = {**before, "abort": before.get("abort", 0) + 1}
    assert _wait(lambda: _finish_reasons(http) == want), (before, _finish_reasons(http))
    stats = _wait_idle(server)
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


@pytest.mark.parametrize("spec_version", ["server", "2.4"])
def test_stream_disconnect_before_first_chunk_aborts(spec_version: str) -> None:
    """A client that leaves during a long prefill is aborted at once, not run to max_tokens.

    ``2.4``: the ASGI scope says spec 2.4, under which Starlette's StreamingResponse stops
    listening for ``http.disconnect`` itself (uvicorn's own scope says 2.3), so the server
    must watch the connection on its own.
    """
    config = EngineConfig(model="tiny", device="cpu", max_model_len=8192, token_budget=16)
    events: list[RequestEvent] = []
    with serve_in_thread(config) as handle:
        client = handle.state.client
        client.add_listener(lambda e: events.append(e) if isinstance(e, RequestEvent) else None)
        if spec_version != "server":
            inner = handle.server.config.loaded_app  # read by each new connection
            seen: list[str] = []

            async def with_spec(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "http":
                    scope = {**scope, "asgi": {**scope["asgi"], "spec_version": spec_version}}
                    seen.append(scope["asgi"]["spec_version"])
                await inner(scope, receive, send)

            handle.server.config.loaded_app = with_spec
        # ~6000 prompt tokens at 16 per step: hundreds of prefill steps before a first token
        body = json.dumps(
            {"prompt": "x" * 6000, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        ).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((handle.host, handle.port), timeout=10) as sock:
            sock.sendall(head + body)
            deadline = time.monotonic() + 10
            while not events and time.monotonic() < deadline:  # wait until it is in the engine
                time.sleep(0.002)
        # closed without reading a byte: the request must be aborted and its blocks freed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not events or events[-1].kind != "aborted"):
            time.sleep(0.02)
        stats = client.stats()
        assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
        kinds = [e.kind for e in events]
        assert kinds[0] == "arrived" and kinds[-1] == "aborted", kinds
        assert "first_token" not in kinds and "finished" not in kinds, kinds
        metrics = text_string_to_metric_families(httpx.get(handle.base_url + "/metrics").text)
        finished = {
            s.labels["finished_reason"]: s.value
            for f in metrics
            if f.name == "chunkscope:request_success"
            for s in f.samples
            if s.name.endswith("_total")
        }
        assert finished == {"abort": 1.0}
        if spec_version != "server":
            assert seen == [spec_version, spec_version]  # the request, then GET /metrics


# --- bad input: each error, then a valid request still succeeds ------------------------------


def _valid(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def _expect_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    return err


def _image_body(url: str) -> dict[str, Any]:
    part = {"type": "image_url", "image_url": {"url": url}}
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    # refused at the edge by wire.strict_json (one rule with the collector), not by a field
    ("NaN in the body", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("Infinity in the body", "/v1/completions", b'{"prompt": "x", "max_tokens": Infinity}',
     400, None),
    ("nested past the limit", "/v1/completions",
     b'{"prompt": "x", "user_data": ' + b"[" * 40 + b"]" * 40 + b"}", 400, None),
    ("nested past the recursion limit", "/v1/completions",
     b'{"prompt": "x", "user_data": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("mistyped max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400,
     "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400,
     "max_tokens"),
    ("temperature out of range", "/v1/completions", {"prompt": "x", "temperature": 9}, 400,
     "temperature"),
    ("top_p out of range", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("prompt longer than context", "/v1/completions", {"prompt": "y" * (MAX_MODEL_LEN + 5)},
     400, "prompt"),
    ("prompt + max_tokens beyond context", "/v1/completions",
     {"prompt": "y" * 100, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 400, "model"),
    ("chat without messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("chat bad role", "/v1/chat/completions",
     {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("undecodable image", "/v1/chat/completions",
     _image_body("data:image/png;base64," + base64.b64encode(b"garbage" * 10).decode()), 400,
     "messages[0].content[0]"),
    ("bad base64 image", "/v1/chat/completions", _image_body("data:image/png;base64,!!!"), 400,
     "messages[0].content[0]"),
    ("gif image", "/v1/chat/completions", _image_body("data:image/gif;base64,R0lGODlh"), 400,
     "messages[0].content[0]"),
    ("remote image", "/v1/chat/completions", _image_body("https://example.com/x.png"), 400,
     "messages[0].content[0]"),
    ("oversized image", "/v1/chat/completions", _image_body(_image_url(300, 300)), 400,
     "messages[0].content[0]"),
    ("more images than --limit-mm-per-prompt", "/v1/chat/completions",
     {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}] * 9}]},
     400, "messages"),
    ("bad traffic class", "/v1/completions", {"prompt": "x"}, 400, "X-Traffic-Class"),
    ("image placeholder without an image", "/v1/completions", {"prompt": [256, 258, 65]}, 400,
     None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_input_is_refused_and_engine_untouched(
    server: ServerHandle, http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    _wait_idle(server)
    before = server.state.client.stats()
    headers = {"X-Traffic-Class": "not valid!"} if param == "X-Traffic-Class" else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers["Content-Type"] = "application/json"
    err = _expect_error(http.post(path, content=content, headers=headers), status)
    if param is not None:
        assert err["param"] == param, err
    after = server.state.client.stats()
    assert after.step == before.step and after.num_waiting == 0 and after.num_running == 0
    _valid(http)


def test_oversized_body_413(http: httpx.Client) -> None:
    body = json.dumps({"prompt": "z" * (MAX_BODY + 10)}).encode()
    err = _expect_error(
        http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
        413,
    )
    assert err["code"] == "request_too_large"
    _valid(http)


def test_scheduler_errors(server: ServerHandle, http: httpx.Client) -> None:
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    before = http.get("/v1/scheduler").json()
    _expect_error(http.put("/v1/scheduler", json={"token_budget": 64}), 401)
    wrong = {"Authorization": "Bearer wrong"}
    _expect_error(http.put("/v1/scheduler", json={"token_budget": 64}, headers=wrong), 401)
    _expect_error(http.put("/v1/scheduler", json={"token_budget": 0}, headers=auth), 400)
    _expect_error(http.put("/v1/scheduler", json={"token_budget": 10**9}, headers=auth), 400)
    # one good and one bad value: nothing changes
    both = {"token_budget": 64, "policy": "fastest"}
    assert _expect_error(http.put("/v1/scheduler", json=both, headers=auth), 400)["param"] == (
        "policy"
    )
    _expect_error(http.put("/v1/scheduler", json={"budget": 64}, headers=auth), 400)
    _expect_error(http.put("/v1/scheduler", json={}, headers=auth), 400)
    _expect_error(http.put("/v1/scheduler", content=b"{nope", headers=auth), 400)
    assert http.get("/v1/scheduler").json()["token_budget"] == before["token_budget"]
    _valid(http)


def test_unknown_route_is_openai_error(http: httpx.Client) -> None:
    _expect_error(http.get("/v1/nothing-here"), 404)


# --- a server of its own: queue full and step-loop crashes -----------------------------------


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerHandle]:
    """One request runs at a time and one may wait: a full queue is easy to reach."""
    config = EngineConfig(
        model="tiny", device="cpu", max_model_len=4096, max_num_seqs=1, max_waiting=1
    )
    with serve_in_thread(config) as handle:
        yield handle


def _fill_queue_then(handle: ServerHandle, probe: Callable[[httpx.AsyncClient], Any]) -> Any:
    """Run ``probe`` while one request runs (a long one) and one waits (max_waiting=1)."""
    long = {"prompt": "q", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    client = handle.state.client

    async def run() -> Any:
        async with httpx.AsyncClient(base_url=handle.base_url, timeout=30) as ac:
            async with ac.stream("POST", "/v1/completions", json=long) as r1:
                lines = r1.aiter_lines()  # keep the iterator: closing it closes r1
                await lines.__anext__()  # the first request is running
                async with ac.stream("POST", "/v1/completions", json=long) as r2:
                    deadline = time.monotonic() + 10  # the second waits (max_num_seqs=1)
                    while client.stats().num_waiting < 1 and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    assert client.stats().num_waiting == 1
                    result = await probe(ac)
                    assert (r1.status_code, r2.status_code) == (200, 200)
                    return result

    result = asyncio.run(run())
    assert _wait(lambda: client.stats().kv_blocks_used == 0)  # both aborted when closed
    return result


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _expect_queue_full(r: httpx.Response) -> None:
    err = _expect_error(r, 503)
    assert err["code"] == "queue_full" and r.headers.get("retry-after") == "1"


def test_queue_full_503_then_recovers(small_server: ServerHandle) -> None:
    async def probe(ac: httpx.AsyncClient) -> httpx.Response:
        return await ac.post("/v1/completions", json={"prompt": "x"})

    _expect_queue_full(_fill_queue_then(small_server, probe))
    with httpx.Client(base_url=small_server.base_url, timeout=30) as http:
        _valid(http)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_late_queue_full_is_503_not_500(
    small_server: ServerHandle, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """The server's count of waiting requests can be a step old; when the engine core's own
    check refuses, the client still gets the 503 with Retry-After (not a 500, not an SSE error
    after a 200). Simulated by switching the server-side count off."""
    import engine.process.client as client_module

    monkeypatch.setattr(client_module, "check_queue", lambda num_waiting, limits: None)

    async def probe(ac: httpx.AsyncClient) -> httpx.Response:
        body = {"prompt": "x", "max_tokens": 2, "stream": stream}
        return await ac.post("/v1/completions", json=body)

    _expect_queue_full(_fill_queue_then(small_server, probe))
    assert small_server.state.client.stats().num_waiting == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_late_invalid_request_is_400_not_500(
    server: ServerHandle, http: httpx.Client, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A request only the engine core refuses (here: the server-side checks switched off) is a
    400 with the engine's reason."""
    import engine.process.client as client_module

    monkeypatch.setattr(client_module, "check_request", lambda prompt, *a: list(prompt))
    body = {"prompt": [256, 258, 65], "max_tokens": 2, "stream": stream}
    err = _expect_error(http.post("/v1/completions", json=body), 400)
    assert "image placeholder" in err["message"] and err["code"] == "invalid_value"
    monkeypatch.undo()
    _valid(http)


def test_control_does_not_stall_streams(
    server: ServerHandle, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a PUT /v1/scheduler waits for the engine core's answer, other requests keep
    streaming: the answer is held back until a whole stream has gone through, then the PUT
    reports what was applied."""
    client = server.state.client
    held: list[tuple[int, Any]] = []
    answer_held = threading.Event()
    resolve = client._resolve_call

    def hold(call_id: int, reply: Any) -> None:
        held.append((call_id, reply))
        answer_held.set()

    monkeypatch.setattr(client, "_resolve_call", hold)
    order: list[str] = []
    put_result: list[httpx.Response] = []

    def put() -> None:
        auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            put_result.append(c.put("/v1/scheduler", json={"token_budget": 200}, headers=auth))
        order.append("control answered")

    putter = threading.Thread(target=put)
    putter.start()
    assert answer_held.wait(30), "the control never reached the engine core"
    body = {"prompt": "still flowing", "max_tokens": 6, "ignore_eos": True, "stream": True}
    r = http.post("/v1/completions", json=body)
    chunks = [line for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and len(chunks) == 6
    order.append("stream done")
    monkeypatch.undo()
    resolve(*held[0])
    putter.join(30)
    assert order == ["stream done", "control answered"]
    change = put_result[0].json()
    assert put_result[0].status_code == 200, change
    assert change["token_budget"] == 200 and change["changes"][0]["accepted"] is True
    assert change["applied_at_step"] == change["changes"][0]["applied_at_step"] is not None
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    assert http.put("/v1/scheduler", json={"token_budget": 256}, headers=auth).status_code == 200


def test_step_crash_fails_requests_but_loop_survives() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=256))
    real_step = engine.step
    crashes = {"left": 1}

    def flaky_step() -> Any:
        if crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step  # type: ignore[method-assign]
    with (
        serve_in_thread(engine) as handle,
        httpx.Client(base_url=handle.base_url, timeout=30) as http,
    ):
        r = http.post("/v1/completions", json={"prompt": "boom", "max_tokens": 3})
        err = _expect_error(r, 500)
        assert "injected step failure" in err["message"]
        health = http.get("/health").json()
        assert health["step_loop_alive"] and health["step_errors"] == 1
        _valid(http)


def test_stop_string_ends_generation(server: ServerHandle, http: httpx.Client) -> None:
    body = {"prompt": "stop test", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    clean = [i for i in range(3, len(full) - 1) if "\ufffd" not in full[i : i + 2]]
    if not clean:
        pytest.skip("greedy output has no clean two-character substring")
    stop = full[clean[0] : clean[0] + 2]
    expected = full[: full.index(stop)]
    _wait_idle(server)
    before = _finish_reasons(http)
    for stream in (False, True):
        r = http.post("/v1/completions", json={**body, "stop": [stop], "stream": stream})
        assert r.status_code == 200
        if stream:
            chunks = [
                json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
            ]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = r.json()["choices"][0]["text"]
            reason = r.json()["choices"][0]["finish_reason"]
        assert text == expected and reason == "stop"
    # the server aborts each in the engine with reason "stop": the metrics count two stops
    want = {**before, "stop": before.get("stop", 0) + 2}
    assert _wait(lambda: _finish_reasons(http) == want), (before, _finish_reasons(http))
    _wait_idle(server)
    assert server.state.client.stats().kv_blocks_used == 0


def _finish_reasons(http: httpx.Client) -> dict[str, float]:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return {
        s.labels["finished_reason"]: s.value
        for f in families
        if f.name == "chunkscope:request_success"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_a_big_body_is_prepared_off_the_event_loop(
    server: ServerHandle, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a big body is being tokenized, /health answers and another request's stream keeps
    flowing: ordering, not timing (planted: prepared inline -> the big body comes first)."""
    tokenizer = server.state.client.tokenizer
    original = tokenizer.encode
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def encode(text: str, *args: Any, **kwargs: Any) -> Any:
        if text.startswith("BIG"):
            entered.set()
            release.wait(30)  # the test releases it; inline, this blocks the loop for 30 s
            order.append("big body prepared")
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    _wait_idle(server)
    big = json.dumps({"prompt": "BIG" + "b" * 200_000, "max_tokens": 1}).encode()
    stream_req = {"prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as slow:
        with http.stream("POST", "/v1/completions", json=stream_req) as stream:
            lines = (line for line in stream.iter_lines() if line.startswith("data: {"))
            next(lines)  # the stream is flowing
            answer: list[httpx.Response] = []
            poster = threading.Thread(
                target=lambda: answer.append(
                    slow.post(
                        "/v1/completions",
                        content=big,
                        headers={"Content-Type": "application/json"},
                    )
                )
            )
            poster.start()
            assert entered.wait(60), "the big body never reached the tokenizer"
            assert http.get("/health").status_code == 200
            order.append("health")
            for _ in range(3):
                next(lines)
            order.append("stream chunks")
            release.set()
            poster.join(120)
    assert order == ["health", "stream chunks", "big body prepared"]
    assert answer and answer[0].status_code == 400  # longer than the context: refused, cleanly
