"""The traffic launcher's command line and lifecycle (against loadgen's mock server), and the
attach-mode stack."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from dashboard.processes import ManagedProcess, python_argv
from dashboard.services import (
    PROFILES,
    Stack,
    TrafficLauncher,
    launcher_shapes,
    loadgen_argv,
    overload_message,
)
from dashboard.settings import parse_settings
from loadgen.shapes import shaped_profiles


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[3::2], argv[4::2], strict=False))


def test_loadgen_argv_carries_the_preset() -> None:
    argv = loadgen_argv(
        "http://127.0.0.1:8000", "mixed", rate=1.5, duration=60, seed=7, out=Path("/tmp/x.json")
    )
    assert argv[:3] == [sys.executable, "-m", "loadgen"]
    flags = _flags(argv)
    assert flags["--url"] == "http://127.0.0.1:8000" and flags["--profile"] == "mixed"
    assert (flags["--rate"], flags["--duration"], flags["--seed"]) == ("1.5", "60", "7")
    # the demo shapes by name, and the chat users beside mixed's own requests
    assert flags["--shapes"] == "demo" and flags["--chat-background"] == "0"
    assert int(flags["--chat-users"]) == PROFILES["mixed"].users >= 3


@pytest.mark.parametrize("profile", ["rag", "vlm"])
def test_rag_and_vlm_presets_bring_chat_users(profile: str) -> None:
    flags = _flags(loadgen_argv("http://h:1", profile, rate=0.3, duration=9, seed=1, out=Path("o")))
    assert int(flags["--chat-users"]) == PROFILES[profile].users >= 3
    assert flags["--chat-background"] == "0"  # closed-loop users, no open-loop rate
    assert flags["--rate"] == "0.3" and flags["--shapes"] == "demo"
    argv = loadgen_argv("http://h:1", profile, rate=0.3, duration=9, seed=1, out=Path("o"), users=0)
    assert _flags(argv)["--chat-users"] == "0"
    with pytest.raises(ValueError, match="chat users must be in"):
        loadgen_argv("http://h:1", profile, rate=0.3, duration=9, seed=1, out=Path("o"), users=-1)
    # the user's own background rate (0 = none) goes through as given
    argv = loadgen_argv(
        "http://h:1", profile, rate=0.3, duration=9, seed=1, out=Path("o"), background=0
    )
    assert _flags(argv)["--chat-background"] == "0"
    argv = loadgen_argv(
        "http://h:1", profile, rate=0.3, duration=9, seed=1, out=Path("o"), background=2.5
    )
    assert _flags(argv)["--chat-background"] == "2.5"


def test_the_presets_are_loadgens_demo_shapes_and_mixed_has_images() -> None:
    demo = shaped_profiles("demo")
    assert PROFILES["rag"].rate == demo.rag.rate and PROFILES["vlm"].rate == demo.vlm.rate
    assert PROFILES["rag"].background == demo.chat.background_rate
    assert PROFILES["rag"].users == PROFILES["mixed"].users == demo.chat.background_users
    assert PROFILES["chat"].users == 0
    assert demo.mixed.vlm_share > 0 and demo.mixed.rag_share > 0 and demo.mixed.chat_share > 0
    # every prompt of the demo shapes fits one step of the starting budget (4096)
    assert demo.rag.doc_max <= 4096


def test_the_launcher_names_demo_shapes_only_for_a_demo_preset() -> None:
    assert launcher_shapes("demo") == "demo" and launcher_shapes("tiny") == "demo"
    assert launcher_shapes("/models/llama") == "auto" and launcher_shapes(None) == "auto"


def test_overload_message_compares_offered_with_served() -> None:
    assert overload_message(1.0, 55, 60.0) is None  # 0.92 req/s served: keeps up
    text = overload_message(2.0, 30, 60.0)  # 0.5 req/s served of 2 offered
    assert text is not None and "Offered 2.00 req/s" in text and "0.50 req/s" in text
    assert overload_message(0.0, 0, 60.0) is None


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"profile": "bulk"}, "profile must be one of"),
        ({"rate": 0}, "rate must be > 0"),
        ({"duration": -1}, "duration must be > 0"),
        ({"url": "127.0.0.1:8000"}, "http://HOST:PORT"),
        ({"background": -1.0}, "chat background must be >= 0"),
        ({"shapes": "huge"}, "shapes must be one of"),
    ],
)
def test_loadgen_argv_refuses_bad_values(kwargs: dict, reason: str) -> None:
    args = {"url": "http://h:1", "profile": "chat", "rate": 1.0, "duration": 1.0}
    args.update(kwargs)
    url, profile = args.pop("url"), args.pop("profile")
    with pytest.raises(ValueError, match=reason):
        loadgen_argv(url, profile, seed=0, out=Path("x.json"), **args)


@pytest.fixture
def mock_server(tmp_path: Path):
    p = ManagedProcess(
        "mock", python_argv("loadgen.mockserver", "--port", "0"), tmp_path / "mock.log"
    ).start()
    try:
        yield p.wait_ready(re.compile(r"mock listening on (http://\S+)"), timeout=60)
    finally:
        p.stop()


def test_launcher_runs_to_the_end_and_writes_its_result(tmp_path: Path, mock_server: str) -> None:
    lch = TrafficLauncher(tmp_path)
    assert lch.state() == "idle"
    lch.start(mock_server, "chat", rate=5.0, duration=1.0)
    assert lch.running and lch.state().startswith("running: chat at 5 req/s for 1 s")
    assert lch.offered_rps == 5.0
    with pytest.raises(RuntimeError, match="already going"):
        lch.start(mock_server, "chat", rate=5.0, duration=1.0)
    assert lch.run is not None and lch.run.proc is not None
    lch.run.proc.wait(timeout=120)
    assert lch.state().startswith("done: chat")
    results = list((tmp_path / "loadgen").glob("*.json"))
    assert len(results) == 1 and json.loads(results[0].read_text())


def test_launcher_stop_interrupts_a_run(tmp_path: Path, mock_server: str) -> None:
    lch = TrafficLauncher(tmp_path)
    lch.start(mock_server, "chat", rate=2.0, duration=600.0)
    time.sleep(1.0)
    lch.stop()
    assert not lch.running
    assert lch.state().startswith("stopped: chat")


def test_attach_mode_starts_nothing(tmp_path: Path) -> None:
    s = parse_settings(["--collector", "ws://127.0.0.1:9", "--db", "sqlite:////tmp/none.db"])
    stack = Stack(s).start()
    assert not stack.embedded and not stack.starting and stack.children() == []
    assert (stack.collector_url, stack.db_url) == ("ws://127.0.0.1:9", "sqlite:////tmp/none.db")


def test_one_embedded_stack_per_data_folder(tmp_path: Path) -> None:
    import subprocess

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); "
            "fcntl.flock(f, fcntl.LOCK_EX); f.write(str(os.getpid())); f.flush(); "
            "print('locked', flush=True); time.sleep(60)",
            str(tmp_path / ".dashboard.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        s = parse_settings(["--data-dir", str(tmp_path)])
        stack = Stack(s).start()
        assert stack.wait_started(30)
        assert stack.error is not None and f"pid {holder.pid}" in stack.error
        assert "--data-dir" in stack.error and stack.children() == []
    finally:
        holder.kill()
        holder.wait(10)


def test_an_engine_follows_the_collector_to_its_new_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector dies and "Restart stopped processes" brings it back on another port: the
    engine, still alive, is started again with the new address (else it publishes to nobody)."""
    import dashboard.services as services

    counter = tmp_path / "n"
    fake_collector = (
        "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); "
        "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
        "print(f'collector listening on ws://127.0.0.1:{40000 + n}', flush=True); time.sleep(120)"
    )
    fake_engine = (
        "import sys, time; url = sys.argv[sys.argv.index('--collector-url') + 1]; "
        "print('engine for', url, flush=True); "
        "print('chunkscope engine listening on http://127.0.0.1:1', flush=True); time.sleep(120)"
    )

    def argv(module: str, *args: str) -> list[str]:
        if module == "storage":
            return [sys.executable, "-c", fake_collector, str(counter)]
        return [sys.executable, "-c", fake_engine, *args]

    monkeypatch.setattr(services, "python_argv", argv)
    stack = Stack(parse_settings(["--data-dir", str(tmp_path / "data")])).start()
    try:
        assert stack.wait_started(60) and stack.error is None, stack.error
        assert stack.collector_url == "ws://127.0.0.1:40001"
        assert stack.engine is not None and "--collector-url" in stack.engine.argv
        first_engine = stack.engine
        assert first_engine.argv[first_engine.argv.index("--collector-url") + 1].endswith("40001")
        assert stack.collector is not None
        stack.collector.stop()  # the collector "crashes"; the engine lives on
        assert first_engine.alive()
        stack.restart()
        assert stack.wait_started(60) and stack.error is None, stack.error
        assert stack.collector_url == "ws://127.0.0.1:40002"
        assert stack.engine is not first_engine and not first_engine.alive()
        assert stack.engine.argv[stack.engine.argv.index("--collector-url") + 1].endswith("40002")
        assert "engine for ws://127.0.0.1:40002" in stack.engine.log_since_start(10_000)
    finally:
        stack.stop()
