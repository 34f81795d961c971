"""The engine core in a child process (the server's default): what only a process can do.

The whole server suite (``test_server.py``) runs against this mode; here: a core that dies
under its server, a core that cannot start, and no core outliving a killed server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from engine.core.config import EngineConfig
from engine.process.client import EngineClient, EngineStartError
from engine.server.cli import build_parser
from engine.server.serve import serve_in_thread

ROOT = Path(__file__).resolve().parents[3]
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


def test_killed_core_fails_requests_and_health_503() -> None:
    """A stream in flight ends with an error chunk (a hang would hit the client's read
    timeout); later requests and controls get 503 engine_dead."""
    before = set(multiprocessing.active_children())
    handle = serve_in_thread(_config())
    client = handle.state.client
    pid = client.pid
    try:
        with httpx.Client(base_url=handle.base_url, timeout=10) as http:
            body = {"prompt": "p", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.kill(pid, signal.SIGKILL)
                rest = list(lines)  # the stream ends with an error chunk, not a hang
            assert any('"engine_error"' in line for line in rest), rest[-3:]
            assert "data: [DONE]" in rest
            health = http.get("/health")
            assert health.status_code == 503
            assert "died" in health.json()["last_error"]
            assert "SIGKILL" in health.json()["last_error"]
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            auth_free = http.put("/v1/scheduler", json={"token_budget": 64})
            assert auth_free.status_code == 503
            assert auth_free.json()["error"]["code"] == "engine_dead"
    finally:
        handle.stop()
    assert _gone(pid) and set(multiprocessing.active_children()) == before


def test_control_pending_when_the_core_dies_is_engine_dead() -> None:
    """A scheduler change whose answer never comes (the core was killed first) ends with
    engine_dead: no hang, and no timeout that could misreport a change the core applied."""
    from engine.process.errors import APIError
    from engine.server.control import apply_scheduler_update

    client = EngineClient.spawn(_config())
    try:
        held = threading.Event()
        client._resolve_call = lambda call_id, reply: held.set()  # type: ignore[method-assign]

        async def change_then_kill() -> None:
            task = asyncio.ensure_future(
                apply_scheduler_update(client, {"token_budget": 64}, source="test")
            )
            assert await asyncio.to_thread(held.wait, 30)  # the core answered; we hold it
            os.kill(client.pid, signal.SIGKILL)
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(task, 30)
            assert info.value.code == "engine_dead" and "SIGKILL" in info.value.message

        asyncio.run(change_then_kill())
        assert not client.alive
    finally:
        client.shutdown()


def test_bad_model_fails_to_start_without_a_child() -> None:
    before = set(multiprocessing.active_children())
    with pytest.raises(EngineStartError, match="unknown model"):
        EngineClient.spawn(_config(model="no-such-preset"))
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
