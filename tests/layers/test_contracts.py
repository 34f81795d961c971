"""The layer contracts (pyproject's [tool.importlinter]) hold, and catch an arrow planted upward.

scripts/test.sh runs ``lint-imports`` on the tree; here a temporary copy of the packages gets
one planted import, and the contracts must fail naming it (a clean copy passes, so the failure
is the plant's).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "chunkscope",
    "benchmarks",
    "dashboard",
    "loadgen",
    "advisor",
    "engine",
    "testkit",
    "storage",
    "wire",
)
LINT = Path(sys.executable).with_name("lint-imports")

PLANTS = {
    "clean": None,
    "core imports the server": ("engine/core/scheduler.py", "import engine.server.app"),
    "wire imports storage": ("wire/events.py", "import storage.db"),
    "storage imports torch": ("storage/packing.py", "import torch"),
}


def _copy(tmp: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(
            ROOT / pkg, tmp / pkg, ignore=shutil.ignore_patterns("__pycache__", "results")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")


@pytest.mark.parametrize("plant", list(PLANTS))
def test_contracts_fail_on_a_planted_import(tmp_path: Path, plant: str) -> None:
    _copy(tmp_path)
    if PLANTS[plant] is not None:
        path, line = PLANTS[plant]
        target = tmp_path / path
        target.write_text(target.read_text() + f"\n{line}  # planted\n")
    out = subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if PLANTS[plant] is None:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 broken" in out.stdout
    else:
        assert out.returncode != 0, out.stdout
        assert "BROKEN" in out.stdout and PLANTS[plant][1].split()[-1] in out.stdout, out.stdout
