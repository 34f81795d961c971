"""``streamlit run dashboard`` as a subprocess for the no-orphan and browser tests."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from websockets.asyncio.client import connect

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc), alive now."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class StreamlitServer:
    """The dashboard's Streamlit server on a free port, its logs in ``tmp_path``."""

    def __init__(
        self, tmp_path: Path, *, env: dict[str, str] | None = None, args: list[str] | None = None
    ) -> None:
        self.port = free_port()
        self.data_dir = tmp_path / "data"
        self.log_path = tmp_path / "streamlit.log"
        self.env = {
            **os.environ,
            "CHUNKSCOPE_DATA_DIR": str(self.data_dir),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        for k in ("CHUNKSCOPE_COLLECTOR_URL", "CHUNKSCOPE_DB_URL"):
            if env is None or k not in env:
                self.env.pop(k, None)
        self.args = list(args or [])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> StreamlitServer:
        argv = [
            sys.executable, "-m", "streamlit", "run", "dashboard",
            "--server.address", "127.0.0.1", "--server.port", str(self.port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--client.toolbarMode", "viewer",
        ]  # fmt: skip
        if self.args:
            argv += ["--", *self.args]
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes it
        self.proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"streamlit exited early:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"streamlit not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def child_log(self, name: str) -> str:
        try:
            return (self.data_dir / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def open_session(self, hold_s: float = 3.0) -> None:
        """Run the script once as a browser would (a session on the websocket, one rerun)."""
        from streamlit.proto.BackMsg_pb2 import BackMsg
        from streamlit.proto.ClientState_pb2 import ClientState

        async def go() -> None:
            url = f"ws://127.0.0.1:{self.port}/_stcore/stream"
            async with connect(url, subprotocols=["streamlit"], proxy=None, max_size=None) as ws:
                msg = BackMsg()
                msg.rerun_script.CopyFrom(ClientState(query_string="", page_script_hash=""))
                await ws.send(msg.SerializeToString())
                end = time.monotonic() + hold_s
                while time.monotonic() < end:
                    try:
                        await asyncio.wait_for(ws.recv(), timeout=0.5)
                    except TimeoutError:
                        pass

        asyncio.run(go())

    def wait_for_children(self, timeout: float = 180.0) -> None:
        """Until the embedded collector and engine have logged their ready lines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "collector listening on" in self.child_log("collector") and (
                "chunkscope engine listening on" in self.child_log("engine")
            ):
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(
            f"embedded stack not up:\n--- streamlit\n{self.log()}\n--- collector\n"
            f"{self.child_log('collector')[-2000:]}\n--- engine\n{self.child_log('engine')[-2000:]}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        return self.proc.returncode
