"""The wire contract is stdlib only: importing it loads no third-party module (no torch, no
numpy), checked in a fresh interpreter started outside the repo (the installed mapping)."""

from __future__ import annotations

import subprocess
import sys


def test_wire_imports_only_the_standard_library(tmp_path: object) -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import wire, wire.control, wire.events, wire.ready\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "bad = sorted(new - set(sys.stdlib_module_names) - {'wire'})\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
