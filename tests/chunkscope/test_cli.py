"""The `chunkscope` command: every subcommand's help, the generated reference (docs/cli.md), the
dispatch of `dashboard`, `advise` and `control`, and the one version."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from chunkscope import cli

ROOT = Path(__file__).resolve().parents[2]

# every job has one, named in docs/cli.md and README.md
EXPECTED = (
    "engine", "collector", "dashboard", "loadgen", "sweep", "advise", "autopilot", "control",
    "export", "blame", "prune", "vllm",
)  # fmt: skip
# progs set by the packages themselves (python -m loadgen and chunkscope loadgen share them)
OWN_PROG = {"loadgen": "loadgen", "sweep": "loadgen sweep"}


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "scripts/cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(argv: list[str]) -> object:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def test_every_job_has_a_subcommand() -> None:
    assert tuple(cli.BY_NAME) == EXPECTED
    usage = cli.usage()
    for name in EXPECTED:
        assert f"\n  {name} " in usage, name
    assert max(len(line) for line in usage.splitlines()) <= 100


HELPS = [[s.name] for s in cli.SUBCOMMANDS] + [
    [s.name, word] for s in cli.SUBCOMMANDS for word in s.nested
]


@pytest.mark.parametrize("words", HELPS, ids=" ".join)
def test_help_exits_0_with_usage(words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _run([*words, "--help"]) in (0, None)
    out = capsys.readouterr().out
    prog = OWN_PROG.get(words[0], " ".join(["chunkscope", *words]))
    assert out.startswith(f"usage: {prog} "), out[:200]
    assert "-h, --help" in out


def test_top_level(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert cli.main(["-h"]) == 0
    assert capsys.readouterr().out.startswith("usage: chunkscope ")
    assert cli.main([]) == 2
    assert cli.main(["nope"]) == 2
    assert "unknown subcommand 'nope'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"chunkscope {_pyproject_version()}\n"


def test_every_help_in_a_fresh_interpreter_imports_no_torch() -> None:
    """`chunkscope SUB --help` for every torch-free job, in one interpreter: none imports torch
    (the engine's own help does not either, but serving it does)."""
    code = (
        "import contextlib, io, sys\n"
        "from chunkscope.cli import main\n"
        f"for words in {[w for w in HELPS if w[0] != 'engine']!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n            main([*words, '--help'])\n"
        "        except SystemExit as exc:\n            assert exc.code == 0, (words, exc.code)\n"
        "    assert 'torch' not in sys.modules, words\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_reference_is_generated_from_the_parsers() -> None:
    """docs/cli.md is what scripts/cli_reference.py prints (run it after changing an option)."""
    ref = _reference()
    text = ref.render()
    assert (ROOT / "docs/cli.md").read_text() == text, (
        "docs/cli.md is out of date: run .venv/bin/python scripts/cli_reference.py"
    )
    for words in HELPS:
        assert f"\n## {' '.join(['chunkscope', *words])}\n" in text


def test_dashboard_runs_streamlit_as_run_sh_does() -> None:
    cmd = cli.dashboard_command(["--port", "8600", "--", "--collector", "ws://h:1", "--db", "x"])
    assert cmd[:4] == [sys.executable, "-m", "streamlit", "run"]
    assert Path(cmd[4]) == ROOT / "dashboard"
    flags = dict(zip(cmd[5::2], cmd[6::2], strict=False))
    assert flags["--server.address"] == "127.0.0.1"
    assert flags["--server.port"] == "8600"
    assert flags["--server.headless"] == "true"
    assert flags["--browser.gatherUsageStats"] == "false"
    assert flags["--client.toolbarMode"] == "viewer"
    assert cmd[-5:] == ["--", "--collector", "ws://h:1", "--db", "x"]
    assert "--" not in cli.dashboard_command([])
    assert "--server.port" in cli.dashboard_command([]) and "8501" in cli.dashboard_command([])


def test_dashboard_checks_its_options_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.dashboard_command(["--", "--no-such-flag"])
    assert info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.dashboard_command(["--", "--help"])
    assert info.value.code == 0
    assert "--collector" in capsys.readouterr().out


def test_advise_is_predict_and_calibrate(monkeypatch: pytest.MonkeyPatch) -> None:
    import advisor.cli

    seen: list[Any] = []
    monkeypatch.setattr(advisor.cli, "run", lambda args: seen.append(args) or 0)
    assert cli.main(["advise", "--db", "sqlite:///s.db", "--budgets", "128,512"]) == 0
    assert cli.main(["advise", "predict", "--db", "sqlite:///s.db"]) == 0
    assert cli.main(["advise", "calibrate", "--url", "http://e", "--out", "c.json"]) == 0
    assert [a.command for a in seen] == ["predict", "predict", "calibrate"]
    assert seen[0].db == "sqlite:///s.db" and seen[0].budgets == [128, 512]
    assert seen[2].url == "http://e"
    # the same namespace python -m advisor predict builds
    same = advisor.cli.build_parser().parse_args(["predict", "--db", "sqlite:///s.db"])
    assert vars(same) == vars(seen[1])


def test_advise_needs_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["advise"]) == 2
    assert "--db" in capsys.readouterr().err


def test_control_sets_and_lists_through_a_collector(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["control", "--engine", "e"]) == 2
    assert "nothing to change" in capsys.readouterr().err
    url = "ws://127.0.0.1:9"  # nothing listens
    args = ["--url", url, "--engine", "e", "--token-budget", "256", "--timeout", "2"]
    assert _run(["control", *args]) == 2
    assert capsys.readouterr().err.startswith("chunkscope control: ")
    assert _run(["control", "engines", "--url", url, "--timeout", "2"]) == 2
    assert capsys.readouterr().err.startswith("chunkscope control engines: ")


def _pyproject_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_one_version() -> None:
    """pyproject.toml holds the version; the packages read it from the installed metadata (an
    editable install: reinstall after changing it)."""
    import chunkscope
    import engine
    import loadgen

    assert chunkscope.__version__ == engine.__version__ == _pyproject_version()
    assert loadgen.__version__ == _pyproject_version()
