"""`python -m engine` / `chunkscope engine`: help text and a real start on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from chunkscope.cli import main as chunkscope_main
from engine.server.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        chunkscope_main(["engine", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--model", "--host", "--port", "--token-budget", "--max-token-budget", "--policy",
        "--max-model-len", "--kv-blocks", "--kv-memory-fraction", "--max-waiting",
        "--collector-url", "--control-token", "--engine-id", "--image-token-cap",
    ):  # fmt: skip
        assert flag in out, flag
    assert "telemetry" in out


def test_parser_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.token_budget, args.policy) == (
        "127.0.0.1",
        8000,
        512,
        "chunked",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-blocks", "10", "--kv-memory-fraction", "0.5"])


def test_bad_config_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.server.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--token-budget", "0"])
    assert info.value.code == 2
    assert "token_budget" in capsys.readouterr().err


def test_python_m_engine_starts_and_serves() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "--model", "tiny", "--device", "cpu", "--port", "0",
         "--max-model-len", "256", "--engine-id", "cli-test", "--log-level", "warning"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 90
        url = None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if line.startswith("chunkscope engine listening on "):
                url = line.strip().rsplit(" ", 1)[-1]
                break
        assert url is not None and url.startswith("http://127.0.0.1:")
        assert not url.endswith(":0")
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'engine_id="cli-test"' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode in (0, -signal.SIGINT)
