"""Every benchmark script writes its results through ``_common.write_json``, which records where the
numbers come from: git commit and dirty flag, torch version and threads, the machine, and the full
configuration. No timing is asserted here (performance lives in the scripts' JSON)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name not in ("_common.py", "__init__.py"))


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """``setup`` makes SIGTERM unwind the script; in this test process, put it back after."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def common() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return _load(BENCH / "_common.py")
    finally:
        sys.path.remove(str(BENCH))


def test_write_json_records_provenance_and_config(common: ModuleType, tmp_path: Path) -> None:
    import torch

    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    ap.add_argument("--budget", type=int, default=512)
    args = ap.parse_args(["--quick", "--out-dir", str(tmp_path)])
    assert common.setup(args) == tmp_path
    config = common.config_of(args)
    assert config == {"quick": True, "out_dir": str(tmp_path), "threads": None, "budget": 512}
    common.write_json(tmp_path / "r.json", {"value": 1}, script="x.py", config=config)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert list(doc)[:3] == ["written_at", "provenance", "config"] and doc["value"] == 1
    assert doc["config"] == config
    prov = doc["provenance"]
    assert prov["script"] == "x.py"
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"])
    assert isinstance(prov["git_dirty"], bool)
    assert prov["git_num_changed_paths"] >= len(prov["git_changed_paths"])
    assert prov["git_dirty"] == (prov["git_num_changed_paths"] > 0)
    m = prov["machine"]
    assert m["torch_version"] == torch.__version__
    assert m["torch_num_threads"] == torch.get_num_threads()
    assert m["cpu_count"] >= 1 and m["platform"] and m["python"]


def test_provenance_is_the_tree_at_start_and_a_move_is_recorded(
    common: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit made while a benchmark runs must not pass for the code that ran."""
    states = iter([{"git_commit": "a" * 40, "git_dirty": False}, {"git_commit": "b" * 40,
                   "git_dirty": False}])  # fmt: skip
    monkeypatch.setattr(common, "git_state", lambda: next(states))
    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    common.setup(ap.parse_args(["--out-dir", str(tmp_path)]))
    common.write_json(tmp_path / "r.json", {}, script="x.py", config={})
    prov = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert prov["git_commit"] == "a" * 40
    assert prov["git_at_end"]["git_commit"] == "b" * 40


def test_quick_results_never_land_in_results_dir(common: ModuleType) -> None:
    ap = argparse.ArgumentParser()
    common.add_common_args(ap)
    assert common.setup(ap.parse_args(["--quick"])) == common.QUICK_DIR
    assert common.setup(ap.parse_args([])) == common.RESULTS_DIR
    assert common.QUICK_DIR != common.RESULTS_DIR


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_writes_through_write_json(script: Path) -> None:
    """Statically: the script calls write_json with script= and config=, and writes no other
    top-level JSON of its own."""
    tree = ast.parse(script.read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "write_json"
    ]
    assert calls, f"{script.name} never calls write_json"
    constants = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for c in calls:
        assert {k.arg for k in c.keywords} >= {"script", "config"}
        value = next(k for k in c.keywords if k.arg == "script").value
        if isinstance(value, ast.Name):  # a module-level constant
            assert constants.get(value.id) == script.name
        elif isinstance(value, ast.Constant):
            assert value.value == script.name
        else:  # computed at run time: Path(__file__).name
            assert ast.unparse(value) == "Path(__file__).name", ast.unparse(value)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_script_has_quick_and_parses(script: Path, capsys: pytest.CaptureFixture) -> None:
    mod = _load(script)
    with pytest.raises(SystemExit) as info:
        mod.main(["--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--quick" in help_text and "--out-dir" in help_text and "--threads" in help_text


def test_results_files_do_not_make_the_tree_dirty(
    common: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    status = " M benchmarks/results/stall.json\n?? benchmarks/results/new.json\n"

    def fake_git(*args: str) -> str:
        return "0" * 40 + "\n" if args[0] == "rev-parse" else status

    monkeypatch.setattr(common, "_git", fake_git)
    state = common.git_state()
    assert state["git_dirty"] is False and state["git_num_changed_paths"] == 0
    assert state["git_changed_results"] == [
        "benchmarks/results/stall.json",
        "benchmarks/results/new.json",
    ]
    status += " M engine/model/runner.py\n"
    state = common.git_state()
    assert state["git_dirty"] is True and state["git_changed_paths"] == ["engine/model/runner.py"]


def test_sigterm_unwinds_a_benchmark_through_its_finally(tmp_path: Path) -> None:
    """After ``setup``, SIGTERM raises SystemExit(143) in the main thread, so the script's
    ``finally`` blocks stop what it started (a plain SIGTERM would end it with its children
    left running)."""
    import subprocess

    script = (
        "import argparse, os, signal, time\n"
        "from benchmarks import _common as c\n"
        "ap = argparse.ArgumentParser(); c.add_common_args(ap)\n"
        f"c.setup(ap.parse_args(['--out-dir', {str(tmp_path)!r}]))\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "finally:\n"
        "    print('children stopped', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 143 and "children stopped" in done.stdout
