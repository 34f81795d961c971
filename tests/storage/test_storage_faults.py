"""A fault test per storage failure (issue 18): the SQLite database locked past the busy timeout,
PostgreSQL restarted mid-run, the data folder's disk full. Each is a real fault (another
connection's lock, a server stop, the kernel refusing writes), none a patched function; each
ends with every acknowledged event stored exactly once, after the engine resends from the
durable seq the collector gives it on reconnect, and ``/healthz`` said 503 meanwhile."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from storage import db as dbm
from testkit.engines import FakeEngineClient, SyntheticEngine
from wire.ready import COLLECTOR_READY, ReadyWatch

from .helpers import stored_seqs, wait_until


def _healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _engine() -> SyntheticEngine:
    return SyntheticEngine(engine_id="eng", run_id="run-f", seed=4, concurrency=4)


def _reconnect_and_resend(url: str, eng: SyntheticEngine, sent: list[dict[str, Any]]) -> int:
    """What the publisher does after a close: hello again, resend everything past the durable
    seq the collector answers with. Returns that durable seq."""
    client = FakeEngineClient(url, eng)
    durable = client.connect()
    client.send_events([e for e in sent if e["seq"] > durable])
    assert client.wait_ack(sent[-1]["seq"]) == sent[-1]["seq"]
    client.close()
    return durable


def _assert_each_once(db_url: str, eng: SyntheticEngine, acked: int) -> None:
    seqs = stored_seqs(db_url, "eng", "run-f")
    assert seqs == list(range(1, eng.seq + 1)), "lost or doubled seqs"
    assert acked <= eng.seq


def test_sqlite_locked_past_the_busy_timeout(
    collector_factory: Any, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dbm, "BUSY_TIMEOUT_MS", 300)  # the writer gives up after 0.3 s
    col = collector_factory(sqlite_url)
    eng = _engine()
    client = FakeEngineClient(col.url, eng)
    client.connect()
    sent = eng.steps(20)
    client.send_events(sent)
    client.wait_ack(sent[-1]["seq"])
    # another process's connection holds the write lock for 2 s (SQLite's own locking)
    path = sqlite_url.removeprefix("sqlite:///")
    locker = sqlite3.connect(path, timeout=5, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        more = eng.steps(10)
        sent += more
        client.send_events(more)
        assert client.wait_closed(15) == 1011  # stored nothing past the durable seq: resend
        acked = client.acked
        status, body = _healthz(col.port)
        assert status == 503 and "locked" in body, (status, body)
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert _reconnect_and_resend(col.url, eng, sent) == acked
    assert _healthz(col.port) == (200, "ok\n")
    _assert_each_once(sqlite_url, eng, acked)


def test_postgresql_restarted_mid_run(collector_factory: Any, pg_server: Any) -> None:
    url = pg_server.create_database()
    col = collector_factory(url)
    eng = _engine()
    client = FakeEngineClient(col.url, eng)
    client.connect()
    sent = eng.steps(20)
    client.send_events(sent)
    client.wait_ack(sent[-1]["seq"])
    pg_server.pause()  # pg_ctl stop -m fast: the collector's connection is cut
    try:
        more = eng.steps(10)
        sent += more
        client.send_events(more)
        assert client.wait_closed(15) == 1011
        acked = client.acked
        status, body = _healthz(col.port)
        assert status == 503 and body.startswith("store:"), (status, body)
    finally:
        pg_server.resume()
    # the writer reconnects on its own (pool pre-ping); the engine resends from the durable seq
    assert _reconnect_and_resend(col.url, eng, sent) == acked
    wait_until(lambda: _healthz(col.port)[0] == 200, 10, "healthz ok again")
    _assert_each_once(url, eng, acked)


def test_disk_full_in_the_data_folder(tmp_path: Path) -> None:
    """The collector in its own process (testkit.disk_full) whose file writes the kernel
    refuses from SIGUSR2 to SIGUSR1: how writes fail on a full disk, without root or a
    loop device."""
    db_url = f"sqlite:///{tmp_path / 'data' / 'chunkscope.db'}"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "testkit.disk_full", "--port", "0", "--db", db_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(root),
    )
    assert proc.stdout is not None
    watch = ReadyWatch(proc.stdout, COLLECTOR_READY)
    try:
        url = watch.wait(60)  # bounds a hang; a loaded machine needs the room to start
        assert url is not None, watch.tail(30)
        port = int(url.rsplit(":", 1)[1])
        eng = _engine()
        client = FakeEngineClient(url, eng)
        client.connect()
        sent = eng.steps(20)
        client.send_events(sent)
        client.wait_ack(sent[-1]["seq"])
        proc.send_signal(signal.SIGUSR2)
        wait_until(lambda: "disk full" in watch.lines, 10, "the disk to fill")
        more = eng.steps(30)
        sent += more
        client.send_events(more)
        assert client.wait_closed(15) == 1011, watch.tail(30)
        acked = client.acked
        status, body = _healthz(port)
        assert status == 503 and ("full" in body or "I/O" in body), (status, body)
        proc.send_signal(signal.SIGUSR1)
        # bounds a hang (CI once saw no "disk has space" within 10 s on a loaded machine; the
        # collector's last lines then say what it was doing)
        try:
            wait_until(lambda: "disk has space" in watch.lines, 30, "space to come back")
        except AssertionError as exc:
            raise AssertionError(watch.tail(30)) from exc
        assert _reconnect_and_resend(url, eng, sent) == acked
        assert _healthz(port) == (200, "ok\n")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    _assert_each_once(db_url, eng, acked)


def test_the_disk_full_wrapper_really_refuses_writes(tmp_path: Path) -> None:
    """The fault above is the kernel's: a write past the limit fails in a child process."""
    code = (
        "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1, resource.getrlimit("
        "resource.RLIMIT_FSIZE)[1]));\n"
        "try:\n    open(r'%s', 'wb').write(b'xx' * 4096)\nexcept OSError as e:\n"
        "    print('refused', e.errno)\n" % (tmp_path / "f")
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "refused" in out.stdout, out.stdout + out.stderr


def test_sqlite_lock_released_while_frames_wait_behind_the_failed_one(
    collector_factory: Any, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault clears while frames are queued behind the failed batch: frame N fails (the
    lock is held past the busy timeout, twice: the batch, then N alone), frame N+1 was accepted
    meanwhile and waits in the writer's queue, and the lock goes before N+1 is written. The
    collector must neither store nor acknowledge N+1 past the hole: the engine reconnects,
    resends from the durable seq, and every seq is stored exactly once."""
    monkeypatch.setattr(dbm, "BUSY_TIMEOUT_MS", 1500)
    col = collector_factory(sqlite_url)
    eng = _engine()
    client = FakeEngineClient(col.url, eng)
    client.connect()
    sent = eng.steps(10)
    client.send_events(sent)
    client.wait_ack(sent[-1]["seq"])
    durable = client.acked
    path = sqlite_url.removeprefix("sqlite:///")
    locker = sqlite3.connect(path, timeout=5, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        n = eng.steps(5)
        client.send_events(n, per_frame=len(n))
        time.sleep(0.5)  # the writer holds frame N alone, waiting for the lock
        later = eng.steps(5)
        client.send_events(later, per_frame=len(later))
        sent += n + later
        assert client.wait_closed(15) == 1011  # frame N failed
    finally:
        locker.execute("ROLLBACK")  # ...and the fault clears with N+1 still queued
        locker.close()
    wait_until(lambda: col._writer._queue.empty(), 10, "the queued frame to be written")
    time.sleep(0.3)  # its result reaches the event loop
    assert client.acked == durable, "acknowledged past a seq that was never stored"
    assert _reconnect_and_resend(col.url, eng, sent) == durable
    _assert_each_once(sqlite_url, eng, durable)
