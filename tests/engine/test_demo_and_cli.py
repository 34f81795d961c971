"""The main job's demo and the `chunkscope` dispatcher, run as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chunkscope import cli
from engine import demo


def test_demo_runs_both_policies_and_reports_stalls(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        demo.main(
            ["--model", "tiny", "--long-prompt", "600", "--streams", "3", "--token-budget", "64"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "policy chunked, budget 64" in out and "policy unchunked" in out
    assert "worst chat stall: chunked" in out
    assert "budget    64 decode" in out  # one line per step


def test_demo_bad_option_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_chunkscope_dispatcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["bogus"]) == 2
    assert "unknown subcommand" in capsys.readouterr().err


def test_chunkscope_loadgen_imports_no_torch() -> None:
    code = (
        "import sys; from chunkscope.cli import main; rc = main(['loadgen', '--show-profiles']);"
        "sys.exit(rc or ('torch' in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"rag"' in done.stdout
