"""``streamlit run dashboard`` alone: it starts a collector and an engine, and leaves no process
behind when Streamlit is stopped (SIGTERM: its clean exit; SIGKILL: the children's
parent-death signal)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.dashboard.server import StreamlitServer, alive, descendants

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_embedded_stack_starts_and_leaves_no_orphan(tmp_path: Path, sig: int) -> None:
    server = StreamlitServer(tmp_path, env={"CHUNKSCOPE_MODEL": "tiny"}).start()
    try:
        server.open_session()
        server.wait_for_children()
        assert server.proc is not None
        kids = descendants(server.proc.pid)
        cmdlines = [
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for pid in kids
            if alive(pid)
        ]
        assert any("-m storage" in c for c in cmdlines), cmdlines
        assert any("-m engine" in c and "--collector-url ws://127.0.0.1:" in c for c in cmdlines)
        # one stack per server process: a second browser session starts nothing new
        server.open_session(hold_s=1.0)
        assert len(server.child_log("engine").split("chunkscope engine listening on")) == 2
    finally:
        rc = server.stop(sig)
    assert rc is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    left = [p for p in kids if alive(p)]
    assert not left, f"orphans after {signal.Signals(sig).name}: {left}"
