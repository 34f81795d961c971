"""``python -m storage`` and ``chunkscope collector``: help, usage errors, no torch."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from chunkscope.cli import main as chunkscope_main
from storage.cli import main


def test_help_explains_every_flag(capsys: Any) -> None:
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--db",
        "--data-dir",
        "--auth-token",
        "--control-token",
        "--max-frame-bytes",
        "--control-timeout",
    ):
        assert flag in out
    assert "0 picks a free one" in out


def test_chunkscope_collector_dispatches_without_torch() -> None:
    code = (
        "import sys\n"
        "from chunkscope.cli import main\n"
        "try:\n    main(['collector', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "assert 'torch' not in sys.modules, 'chunkscope collector imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: chunkscope collector" in out.stdout


def test_usage_errors(tmp_path: Any, capsys: Any) -> None:
    assert main(["--db", "nonsense://", "--port", "0"]) == 2
    assert "unsupported database" in capsys.readouterr().err
    assert main(["--port", "70000"]) == 2
    assert "port must be" in capsys.readouterr().err
    try:
        main(["control", "--engine", "x"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "nothing to change" in capsys.readouterr().err


def test_control_cli_without_collector(capsys: Any) -> None:
    rc = main(
        [
            "control",
            "--url",
            "ws://127.0.0.1:9",
            "--engine",
            "x",
            "--token-budget",
            "5",
            "--timeout",
            "2",
        ]
    )
    assert rc == 2
    assert "python -m storage control" in capsys.readouterr().err


def test_chunkscope_usage_lists_collector(capsys: Any) -> None:
    assert chunkscope_main(["--help"]) == 0
    assert "collector" in capsys.readouterr().out


def test_unreachable_store_and_taken_port(tmp_path: Any, capsys: Any) -> None:
    import socket

    url = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2"
    assert main(["--db", url, "--port", "0"]) == 1
    assert "cannot open the store" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        db = f"sqlite:///{tmp_path / 'x.db'}"
        assert main(["--db", db, "--port", str(port)]) == 1
    assert "cannot listen" in capsys.readouterr().err
