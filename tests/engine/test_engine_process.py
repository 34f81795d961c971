"""Process mode: the engine core in a child process, the HTTP server a thin client of it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.multimodal import encode_data_url, num_image_tokens
from engine.server import ServerHandle, build_parser, serve_in_thread
from engine.serving.engine_proc import EngineClient
from tests.engine.serving_helpers import StepLog

ROOT = Path(__file__).resolve().parents[2]
CONTROL_TOKEN = "s3cret"
MAX_MODEL_LEN = 512


def _config(**kw: object) -> EngineConfig:
    kw = {"model": "tiny", "device": "cpu", "max_model_len": MAX_MODEL_LEN, **kw}
    return EngineConfig(**kw)  # type: ignore[arg-type]


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _gone(pid: int) -> bool:
    """The process no longer runs (reaped, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _kv_usage(http: httpx.Client) -> float:
    families = text_string_to_metric_families(http.get("/metrics").text)
    return next(
        s.value for f in families if f.name == "chunkscope:kv_cache_usage_perc" for s in f.samples
    )


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = serve_in_thread(_config(token_budget=256), control_token=CONTROL_TOKEN)
    assert isinstance(handle.state.engine, EngineClient)
    log = StepLog()
    handle.state.engine.add_listener(log)  # events arrive from the core, one batch per step
    handle.step_log = log  # type: ignore[attr-defined]
    pid = handle.state.engine.pid
    assert pid != os.getpid() and not _gone(pid)
    yield handle
    handle.stop()
    assert _gone(pid)


def test_health_reports_process_mode(http: httpx.Client) -> None:
    body = http.get("/health").json()
    assert body["status"] == "ok" and body["engine_mode"] == "process"


def test_completion_exact_max_tokens_stream_and_not(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="tiny", prompt="hello world", max_tokens=9, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len("hello world") + 1
    assert out.usage.completion_tokens == 9
    assert len(out.model_extra["chunkscope"]["token_times"]) == 9  # type: ignore[index]
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
    assert len(content) == 7 and content[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 7
    assert usage.prompt_tokens == len("stream me") + 1
    assert len(chunks[-1].model_extra["chunkscope"]["token_times"]) == 7  # type: ignore[index]


def test_chat_with_one_image(client: openai.OpenAI) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (100, 150, 3), dtype=np.uint8)
    text = {"type": "text", "text": "what is this?"}
    image = {"type": "image_url", "image_url": {"url": encode_data_url(pixels, "PNG")}}
    base = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": [text]}], max_tokens=2
    )
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [text, image]}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert base.usage is not None and out.usage is not None
    assert out.usage.prompt_tokens == base.usage.prompt_tokens + num_image_tokens(100, 150)
    assert out.usage.completion_tokens == 3


def test_too_long_prompt_is_400_then_a_good_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="y" * (MAX_MODEL_LEN + 5), max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:  # refused by the shared engine checks
        client.completions.create(model="tiny", prompt=[256, 258, 65], max_tokens=2)
    assert "image placeholder" in str(info.value)
    out = client.completions.create(
        model="tiny", prompt="ok", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_scheduler_put_applies_at_reported_step(
    server: ServerHandle, http: httpx.Client, client: openai.OpenAI
) -> None:
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    r = http.put("/v1/scheduler", json={"token_budget": 48}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token_budget"] == 48 and body["changes"][0]["accepted"] is True
    applied = body["applied_at_step"]
    assert applied is not None
    client.completions.create(
        model="tiny", prompt="x" * 200, max_tokens=2, extra_body={"ignore_eos": True}
    )
    log: StepLog = server.step_log  # type: ignore[attr-defined]
    after = [e for e in log.steps if e.step >= applied]
    assert after and after[0].step == applied and after[0].token_budget == 48
    assert all(e.num_scheduled_tokens <= 48 for e in after)
    assert http.get("/v1/scheduler").json()["token_budget"] == 48
    assert "chunkscope:token_budget" in http.get("/metrics").text
    r = http.put("/v1/scheduler", json={"token_budget": 256}, headers=auth)
    assert r.status_code == 200 and r.json()["token_budget"] == 256


def test_disconnect_mid_stream_frees_kv_blocks(server: ServerHandle, http: httpx.Client) -> None:
    assert _wait(lambda: _kv_usage(http) == 0)
    body = {"prompt": "a long one " * 8, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 3:
                    break
            assert _kv_usage(http) > 0
    assert _wait(lambda: _kv_usage(http) == 0), "KV blocks not freed after the client left"
    stats = server.state.engine.stats()
    assert stats.num_running == 0 and stats.kv_blocks_used == 0


def test_killed_core_fails_fast_and_health_503() -> None:
    before = set(multiprocessing.active_children())
    handle = serve_in_thread(_config())
    client = handle.state.engine
    pid = client.pid
    try:
        with httpx.Client(base_url=handle.base_url, timeout=10) as http:
            body = {"prompt": "p", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                rest = list(lines)  # the stream ends with an error chunk, not a hang
            assert time.monotonic() - t0 < 5
            assert any('"engine_error"' in line for line in rest), rest[-3:]
            health = http.get("/health")
            assert health.status_code == 503
            assert "died" in health.json()["last_error"]
            assert "SIGKILL" in health.json()["last_error"]
            t0 = time.monotonic()
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            auth_free = http.put("/v1/scheduler", json={"token_budget": 64})
            assert auth_free.status_code == 503
            assert time.monotonic() - t0 < 5
    finally:
        handle.stop()
    assert _gone(pid) and set(multiprocessing.active_children()) == before


def test_bad_model_fails_to_start_without_a_child() -> None:
    from engine.serving.engine_proc import EngineStartError

    before = set(multiprocessing.active_children())
    with pytest.raises(EngineStartError, match="unknown model"):
        EngineClient(_config(model="no-such-preset"))
    assert set(multiprocessing.active_children()) == before


def test_help_mentions_process_mode() -> None:
    text = build_parser().format_help()
    assert "--engine-in-thread" in text and "child process" in text
    assert build_parser().parse_args([]).engine_in_thread is False


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _start_cli(*extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "--model", "tiny", "--device", "cpu", "--port", "0",
         "--max-model-len", "256", "--log-level", "warning", *extra],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("chunkscope engine listening on "):
            return proc, line.strip().rsplit(" ", 1)[-1]
    proc.kill()
    pytest.fail("the server did not start")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_cli_leaves_no_orphan(how: signal.Signals) -> None:
    """SIGINT: the server stops its engine core; SIGKILL: the core sees its pipe close and
    exits on its own. Either way no engine process outlives the server."""
    proc, url = _start_cli()
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        cores = _children(proc.pid)
        assert cores  # the engine core (and multiprocessing's resource tracker)
        proc.send_signal(how)
        proc.wait(20)
        assert _wait(lambda: all(_gone(p) for p in cores), timeout=10), cores
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
