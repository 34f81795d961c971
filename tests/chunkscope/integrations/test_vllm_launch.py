"""``chunkscope vllm -- <vLLM args>``: the command it runs (no vLLM needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from chunkscope.integrations import vllm_launch
from chunkscope.integrations.vllm_launch import SCHEDULER_CLS, build_command


def test_the_command_sets_the_bridge_and_the_collector(tmp_path: Path) -> None:
    py = tmp_path / "python"
    cmd, env = build_command(
        ["--collector-url", "ws://127.0.0.1:9999", "--engine-id", "vllm-a", "--python", str(py),
         "--", "--model", "m", "--max-num-batched-tokens", "1024"]
    )  # fmt: skip
    assert cmd == [
        str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", "m",
        "--max-num-batched-tokens", "1024", "--shutdown-timeout", "5",
        "--scheduler-cls", SCHEDULER_CLS,
    ]  # fmt: skip
    assert env == {
        "CHUNKSCOPE_COLLECTOR_URL": "ws://127.0.0.1:9999/ingest",
        "CHUNKSCOPE_ENGINE_ID": "vllm-a",
        "CHUNKSCOPE_METRICS_URL": f"http://{socket.gethostname()}:8000/metrics",
    }


def test_the_metrics_url_follows_vllms_host_and_port() -> None:
    _, env = build_command(
        ["--python", "/bin/true", "--", "--model", "m", "--host", "127.0.0.1", "--port=8123"]
    )
    assert env["CHUNKSCOPE_METRICS_URL"] == "http://127.0.0.1:8123/metrics"


@pytest.mark.parametrize("given", [["--shutdown-timeout", "0"], ["--shutdown-timeout=30"]])
def test_a_shutdown_timeout_of_the_user_is_kept(given: list[str]) -> None:
    cmd, _ = build_command(["--python", "/bin/true", "--", "--model", "m", *given])
    assert cmd[3:-2] == ["--model", "m", *given]


@pytest.mark.parametrize(
    ("argv", "wording"),
    [
        (["--", "--model", "m", "--scheduler-cls", "x.Y"], "sets --scheduler-cls itself"),
        (["--", "--port", "8000"], "give vLLM a model"),
        (["--collector-url", "http://x", "--", "--model", "m"], "ws://HOST:PORT"),
    ],
)
def test_bad_arguments_are_refused_clearly(argv: list[str], wording: str) -> None:
    with pytest.raises(ValueError, match=wording):
        build_command(["--python", "/bin/true", *argv])


def test_without_vllm_it_says_to_run_the_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKSCOPE_VLLM_VENV", str(tmp_path / "none"))
    monkeypatch.setattr(vllm_launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="run scripts/setup_vllm.sh"):
        build_command(["--", "--model", "m"])


def test_the_console_script_dispatches_and_reports_errors() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chunkscope.cli", "vllm", "--python", "/bin/true"]
        + ["--", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "give vLLM a model" in out.stderr
