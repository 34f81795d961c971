"""Children of the dashboard die with it: PR_SET_PDEATHSIG (even on SIGKILL) and atexit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dashboard.processes import ManagedProcess, python_argv

# A parent that starts a sleeping child from a short-lived thread (as a Streamlit script thread
# would), prints the child's pid, then waits to be killed (or exits at once with "exit").
PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from dashboard.processes import ManagedProcess
    out = {}
    def start():
        out["p"] = ManagedProcess(
            "sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
            Path(sys.argv[1]) / "sleeper.log",
        ).start()
    t = threading.Thread(target=start); t.start(); t.join()
    print(out["p"].pid, flush=True)
    if sys.argv[2] == "exit":
        sys.exit(0)
    time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent, init, reaps it)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _start_parent(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert re.fullmatch(r"\d+\n", line), line
    return parent, int(line)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_child_dies_when_the_parent_is_killed(tmp_path: Path, sig: int) -> None:
    parent, child = _start_parent(tmp_path, "wait")
    assert _alive(child)
    parent.send_signal(sig)
    parent.wait(timeout=15)
    assert _wait_gone(child), f"child {child} outlived its parent"


def test_children_are_stopped_at_exit(tmp_path: Path) -> None:
    parent, child = _start_parent(tmp_path, "exit")
    assert parent.wait(timeout=30) == 0
    assert _wait_gone(child)


def test_wait_ready_reads_the_address_and_stop_is_idempotent(tmp_path: Path) -> None:
    code = (
        "import time; print('collector listening on ws://127.0.0.1:5555', flush=True); "
        "time.sleep(60)"
    )
    p = ManagedProcess("collector", [sys.executable, "-c", code], tmp_path / "c.log").start()
    try:
        from wire.ready import COLLECTOR_READY

        assert p.wait_ready(COLLECTOR_READY, timeout=30) == "ws://127.0.0.1:5555"
        assert p.state == "running"
    finally:
        p.stop()
    assert p.state == "stopped"
    assert p.stop() is not None  # again: nothing happens


def test_child_that_exits_early_reports_its_log(tmp_path: Path) -> None:
    argv = python_argv("dashboard_no_such_module_xyz")
    p = ManagedProcess("engine", argv, tmp_path / "e.log").start()
    from wire.ready import ENGINE_READY

    with pytest.raises(RuntimeError, match="exited .* before it was ready") as info:
        p.wait_ready(ENGINE_READY, timeout=30)
    assert "No module named" in str(info.value)
    assert p.state == "failed"


def test_ready_timeout_stops_the_child(tmp_path: Path) -> None:
    p = ManagedProcess(
        "engine", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "e.log"
    ).start()
    from wire.ready import ENGINE_READY

    with pytest.raises(RuntimeError, match="not ready after"):
        p.wait_ready(ENGINE_READY, timeout=0.5)
    assert not p.alive()


def test_the_ready_line_is_read_from_this_start_only(tmp_path: Path) -> None:
    """An append-mode log keeps an earlier start's ready line above: a second start (or a
    restart after a crash) must read its own, not the dead port of the first."""
    from wire.ready import COLLECTOR_READY

    log = tmp_path / "c.log"
    log.write_text("collector listening on ws://127.0.0.1:1111\nold run crashed\n")
    code = (
        "import time; time.sleep(0.5); "
        "print('collector listening on ws://127.0.0.1:2222', flush=True); time.sleep(60)"
    )
    p = ManagedProcess("collector", [sys.executable, "-c", code], log).start()
    try:
        assert p.wait_ready(COLLECTOR_READY, timeout=30) == "ws://127.0.0.1:2222"
        # and once more on the same file: the third start reads the third line
        p.stop()
        code3 = code.replace("2222", "3333")
        p = ManagedProcess("collector", [sys.executable, "-c", code3], log).start()
        assert p.wait_ready(COLLECTOR_READY, timeout=30) == "ws://127.0.0.1:3333"
    finally:
        p.stop()
    assert "1111" in log.read_text() and "2222" in log.read_text()  # the history is kept


def test_an_instrument_runs_nicer_than_the_dashboard(tmp_path: Path) -> None:
    code = "import os, time; print('nice', os.nice(0), flush=True); time.sleep(30)"
    p = ManagedProcess("loadgen", [sys.executable, "-c", code], tmp_path / "l.log", nice=5)
    p.start()
    try:
        deadline = time.monotonic() + 20
        while "nice" not in (tmp_path / "l.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"nice {os.nice(0) + 5}" in (tmp_path / "l.log").read_text()
    finally:
        p.stop()


def test_a_page_run_yields_the_cpu_in_its_own_thread_only() -> None:
    import threading

    from dashboard.processes import PAGE_NICE, yield_cpu

    base = os.getpriority(os.PRIO_PROCESS, os.getpid())
    seen: dict[str, int] = {}

    def page_run() -> None:
        yield_cpu()
        yield_cpu()  # once: a second call does not add to it
        seen["page"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=page_run)
    t.start()
    t.join(10)
    assert seen["page"] == base + PAGE_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # this one kept


# A fresh dashboard process: imports the module as a page's script thread would, then a page run
# yields the CPU and starts the engine (nice 0) and the collector (nice 5); prints their pids.
YIELDING_PARENT = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from dashboard.processes import ManagedProcess, yield_cpu
    code = "import time; time.sleep(60)"
    out = {}
    def page_run():
        yield_cpu()
        for name, nice in (("engine", 0), ("collector", 5)):
            out[name] = ManagedProcess(
                name, [sys.executable, "-c", code], Path(sys.argv[1]) / (name + ".log"), nice=nice
            ).start()
    t = threading.Thread(target=page_run); t.start(); t.join()
    print(out["engine"].pid, out["collector"].pid, flush=True)
    time.sleep(60)
    """
)


def test_a_child_started_from_a_page_run_that_yielded_is_not_niced(tmp_path: Path) -> None:
    """The page run that starts the engine has yielded the CPU (its thread runs 5 nicer): the
    engine still runs at the dashboard's own priority, the collector at that + 5."""
    parent = subprocess.Popen(
        [sys.executable, "-c", YIELDING_PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        engine, collector = (int(x) for x in parent.stdout.readline().split())
        base = os.getpriority(os.PRIO_PROCESS, parent.pid)
        assert os.getpriority(os.PRIO_PROCESS, engine) == base
        assert os.getpriority(os.PRIO_PROCESS, collector) == base + 5
    finally:
        parent.kill()
        parent.wait(10)
