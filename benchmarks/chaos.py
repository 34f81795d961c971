"""Chaos run: real engines, a real collector, real faults, then a seq-by-seq audit of the store.

On loopback only, per store (SQLite, PostgreSQL or both, one after the other): one collector
(``python -m storage`` through ``testkit.disk_full``, so its disk can be made full), N engine
servers (``python -m engine --model tiny --engine-in-thread``) publishing through a local TCP proxy
(``testkit.tcp_proxy``) to the collector, and chat clients (streamed and whole answers) on every
engine. A seeded random schedule injects one fault at a time, each kind several times (with
probability ``--overlap`` an engine kill or a connection cut lands in the middle of an outage):

- ``store_lock`` (SQLite): another connection holds the write lock past the collector's busy
  timeout (``BEGIN EXCLUSIVE``); ``postgres_restart`` (PostgreSQL): ``pg_ctl stop -m fast``, a
  pause, ``pg_ctl start`` (``testkit.postgres``);
- ``collector_kill``: SIGKILL, a pause, a new collector on the same port;
- ``engine_kill``: SIGKILL of one engine server, a new one (a new run of the same engine id);
- ``connection_cut``: the proxy resets every engine-collector connection and refuses new ones
  for up to a few seconds;
- ``disk_full`` (SQLite): the collector's file writes fail (``RLIMIT_FSIZE``, testkit.disk_full)
  for a few seconds. Skipped on PostgreSQL: the disk that fills there is the server's, which
  testkit.disk_full does not reach.

At the end the faults are cleared, traffic stops, every live engine is drained (its ``/metrics``
``acked_seq`` reaches its ``last_seq``) and stopped (its goodbye is one more seq), and every run in
the store is audited: each seq the engine published must be stored exactly once (steps, request
events, controls, gaps) or lie in a declared gap whose reason names an injected fault. An engine
that was SIGKILLed takes the events the collector had not yet acknowledged with it: what it had
published is known from a ``/metrics`` scrape just before the kill (a lower bound), every seq up
to the ``acked_seq`` of that scrape must be stored, and the rest is counted apart
(``lost_with_killed_engine_at_least``), not as a silent loss: no process remains to declare it.
Every client request must end with a complete answer (a finish reason, ``usage`` with
``max_tokens`` tokens when it says ``length``, ``[DONE]`` when streamed) or a clear error (an
HTTP status, an error event, a failed connection), and may fail only when its engine was killed
under it.

The first ``--small-buffer-engines`` engines keep few unacknowledged events (200 in memory, 32 KiB
of spill), so outages overflow their buffer and the publisher's declared gaps are exercised too;
for an engine stopped normally, the seqs the store's gaps declare must equal its
``events_dropped``.

    python benchmarks/chaos.py --store both --duration 600 --seed 1   # the long run
    python benchmarks/chaos.py --quick                                 # ~2 minutes, CI's
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/chaos.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REPO_ROOT, add_common_args, config_of, setup, write_json
from testkit.tcp_proxy import TcpProxy
from wire.ready import COLLECTOR_READY, ENGINE_READY

SCRIPT = "chaos.py"

SQLITE_KINDS = ("store_lock", "collector_kill", "engine_kill", "connection_cut", "disk_full")
POSTGRES_KINDS = ("postgres_restart", "collector_kill", "engine_kill", "connection_cut")
SKIPPED_KINDS = {
    "postgres": {
        "disk_full": "testkit/disk_full.py limits the collector process's own file writes; on "
        "PostgreSQL the disk that fills is the server's, which it does not reach"
    },
    "sqlite": {},
}
# Faults that may land in the middle of an outage (--overlap)
OVERLAPPING = ("engine_kill", "connection_cut")
# Faults that stop acknowledgements for a while: the engines' buffers hold events meanwhile, and a
# full buffer is declared in a gap ("telemetry buffer full ...").
ACK_STOPPING = {"store_lock", "postgres_restart", "collector_kill", "connection_cut", "disk_full"}

# The collector, in a process whose disk can be made full (SIGUSR2 / SIGUSR1), with the SQLite
# busy timeout given as the first argument (storage.db reads it at each connect).
COLLECTOR_WRAPPER = (
    "import sys; import storage.db as d; d.BUSY_TIMEOUT_MS = int(sys.argv.pop(1)); "
    "from testkit.disk_full import main; raise SystemExit(main(sys.argv[1:]))"
)


# An engine server whose telemetry buffer is small (memory events, spill bytes: the first two
# arguments), so that an outage overflows it and the publisher declares the events it drops in a
# gap. BufferLimits is the publisher's own setting; the command line does not expose it.
ENGINE_WRAPPER = (
    "import functools, sys; import engine.server.publishing as p; "
    "p.BufferLimits = functools.partial(p.BufferLimits, max_memory_events=int(sys.argv[1]), "
    "max_spill_bytes=int(sys.argv[2]), spill_segment_bytes=max(1, int(sys.argv[2]) // 4)); "
    "from engine.server.cli import main; raise SystemExit(main(sys.argv[3:]))"
)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _wait_line(
    path: Path, pattern: re.Pattern[str], since: int, proc: subprocess.Popen[bytes], timeout: float
) -> str | None:
    """The first group of ``pattern`` in ``path`` after byte ``since``, once it is written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(since)
            m = pattern.search(f.read().decode(errors="replace"))
        if m:
            return m.group(1) if pattern.groups else m.group(0)
        if proc.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _copy_to(stream: Any, path: Path) -> None:
    with open(path, "ab") as f:
        for line in stream:
            f.write(line)
            f.flush()


def _log_count(path: Path, text: str) -> int:
    """Lines of the log at ``path`` that contain ``text`` (0 when there is no log)."""
    try:
        with path.open(errors="replace") as f:
            return sum(text in line for line in f)
    except OSError:
        return 0


# --- the collector ------------------------------------------------------------------------------
class Collector:
    """``python -m storage`` (through testkit.disk_full) on one port, killed and restarted."""

    def __init__(
        self, db_url: str, workdir: Path, busy_timeout_ms: int, extra: list[str] | None = None
    ) -> None:
        self.db_url = db_url
        self.workdir = workdir
        self.extra = extra or []  # more collector flags
        self.busy_timeout_ms = busy_timeout_ms
        self.log = workdir / "collector.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        self.unexpected_exits: list[dict[str, Any]] = []

    def start(self, timeout: float = 60.0) -> None:
        for attempt in range(10):
            self.log.touch()
            since = self.log.stat().st_size
            # a pipe, copied to the log by a thread: once the disk is "full" the collector
            # cannot write to a regular file, its log included
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    COLLECTOR_WRAPPER,
                    str(self.busy_timeout_ms),
                    "--port",
                    str(self.port),
                    "--db",
                    self.db_url,
                    "--log-level",
                    "WARNING",
                    *self.extra,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=_env(),
                cwd=str(self.workdir),
            )
            threading.Thread(
                target=_copy_to, args=(self.proc.stdout, self.log), daemon=True
            ).start()
            url = _wait_line(self.log, COLLECTOR_READY, since, self.proc, timeout)
            if url is not None:
                self.port = int(url.rsplit(":", 1)[1])
                self.starts += 1
                return
            self._reap()
            if self.port == 0 or attempt == 9:
                break
            time.sleep(0.5)  # the port of the one killed may take a moment to be free
        raise RuntimeError(f"the collector did not start:\n{_tail(self.log, 30)}")

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def check_alive(self) -> None:
        """A collector that ended on its own is a finding: note it and start a new one."""
        if self.proc is not None and self.proc.poll() is not None:
            self.unexpected_exits.append(
                {"returncode": self.proc.returncode, "log_tail": _tail(self.log, 30)}
            )
            self.start()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def _signal_and_wait(self, sig: int, line: str, timeout: float = 30.0) -> bool:
        assert self.proc is not None
        since = self.log.stat().st_size
        self.proc.send_signal(sig)
        pattern = re.compile(rf"^{re.escape(line)}$", re.M)
        return _wait_line(self.log, pattern, since, self.proc, timeout) is not None

    def disk_full(self) -> bool:
        return self._signal_and_wait(signal.SIGUSR2, "disk full")

    def disk_free(self) -> bool:
        return self._signal_and_wait(signal.SIGUSR1, "disk has space")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# --- the engines --------------------------------------------------------------------------------
_METRIC = re.compile(r"^chunkscope_telemetry_(\w+?)(?:_total)?\{[^}]*\} (\S+)$", re.M)


@dataclass
class Incarnation:
    """One engine server process: one run of its engine id in the store (found by its pid)."""

    slot: int
    number: int
    pid: int
    url: str
    log: Path
    started: float
    killed: float | None = None
    stopped: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the latest /metrics scrape
    unacked_at_stop: list[str] = field(default_factory=list)


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=timeout).text
    return {m.group(1): float(m.group(2)) for m in _METRIC.finditer(text)}


class EngineSlot:
    """One engine id: an engine server, SIGKILLed and restarted as the schedule says."""

    def __init__(self, index: int, args: argparse.Namespace, collector_url: str, workdir: Path):
        self.index = index
        self.engine_id = f"chaos-{index}"
        self.args = args
        self.collector_url = collector_url
        self.workdir = workdir
        self.incarnations: list[Incarnation] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = threading.Event()
        self.restarter: threading.Thread | None = None
        self.restart_errors: list[str] = []
        self.small_buffer = index < args.small_buffer_engines

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]

    def start(self, timeout: float = 240.0) -> None:
        n = len(self.incarnations)
        log = self.workdir / f"engine-{self.index}-{n}.log"
        if self.small_buffer:
            head = [
                sys.executable,
                "-c",
                ENGINE_WRAPPER,
                str(self.args.small_buffer_events),
                str(self.args.small_buffer_spill_bytes),
            ]
        else:
            head = [sys.executable, "-m", "engine"]
        cmd = [
            *head,
            "--model",
            self.args.model,
            "--port",
            "0",
            "--engine-in-thread",
            "--cpu-threads",
            "1",
            "--engine-id",
            self.engine_id,
            "--collector-url",
            self.collector_url,
            "--seed",
            str(self.args.seed + self.index),
            "--telemetry-spill-dir",
            str(self.workdir / f"spill-{self.index}-{n}"),
            "--log-level",
            "warning",
        ]
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=str(REPO_ROOT)
            )
        url = _wait_line(log, ENGINE_READY, 0, proc, timeout)
        if url is None:
            proc.kill()
            proc.wait(10)
            raise RuntimeError(f"engine {self.engine_id} did not start:\n{_tail(log, 30)}")
        self.proc = proc
        self.incarnations.append(Incarnation(self.index, n, proc.pid, url, log, time.time()))
        self.up.set()

    def kill(self) -> Incarnation:
        """Scrape /metrics (what it published and what was acknowledged), then SIGKILL."""
        assert self.proc is not None
        inc = self.current
        with contextlib.suppress(Exception):
            inc.metrics = scrape(inc.url, timeout=2.0)
        self.up.clear()
        self.proc.send_signal(signal.SIGKILL)
        inc.killed = time.time()
        self.proc.wait(10)
        return inc

    def restart_later(self, delay: float) -> None:
        def run() -> None:
            time.sleep(delay)
            try:
                self.start()
            except Exception as exc:  # noqa: BLE001 - reported in the results
                self.restart_errors.append(str(exc)[-2000:])

        self.restarter = threading.Thread(target=run, name=f"restart-{self.index}", daemon=True)
        self.restarter.start()

    def join_restart(self, timeout: float = 300.0) -> None:
        if self.restarter is not None:
            self.restarter.join(timeout)
            self.restarter = None

    def drain(self, timeout: float) -> bool:
        """Wait until the collector acknowledged every event published (and none came for a
        second); the final scrape is kept."""
        inc = self.current
        deadline = time.monotonic() + timeout
        stable_since = None
        last = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                inc.metrics = scrape(inc.url)
            m = inc.metrics
            done = m and m.get("acked_seq") == m.get("last_seq")
            key = m.get("last_seq")
            if done and key == last:
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since >= 1.0:
                    return True
            else:
                stable_since = None
            last = key
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        """SIGINT: the server stops, its publisher sends what is left and a goodbye."""
        if self.proc is None or self.proc.poll() is not None:
            return
        inc = self.current
        self.up.clear()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        inc.stopped = time.time()
        inc.unacked_at_stop = [
            line for line in _tail(inc.log, 200).splitlines() if "never acknowledged" in line
        ]


# --- the clients --------------------------------------------------------------------------------
WORDS = (
    "engine chunk prefill decode token budget stall latency batch cache block stream "
    "request collector store seq gap fault proxy restart"
).split()


@dataclass
class RequestRecord:
    slot: int
    incarnation: int
    started: float
    ended: float
    stream: bool
    ok: bool
    reason: str  # "ok", or why it failed
    clear: bool  # a complete answer, or an error the client was told (status, exception)
    explained: bool = True  # a failure: its engine was killed under it


def _complete(finish: Any, usage: Any, max_tokens: int) -> str | None:
    """Why an answer is not complete (None: it is): a finish reason, and as many tokens as
    ``max_tokens`` when it says ``length`` (at most that many when ``stop``)."""
    if finish not in ("stop", "length"):
        return f"no finish_reason ({finish!r})"
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(n, int):
        return "no usage.completion_tokens"
    if (finish == "length" and n != max_tokens) or n > max_tokens:
        return f"finish_reason {finish} with {n} of {max_tokens} tokens"
    return None


def one_request(
    client: Any, url: str, model: str, rng: random.Random
) -> tuple[bool, str, bool, bool]:
    """One chat request: (ok, reason, clear, stream). ``clear``: a complete answer, or an error
    the client was told (an HTTP status, an error event, a failed connection)."""
    import httpx

    stream = rng.random() < 0.5
    max_tokens = rng.randint(4, 32)
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))}
        ],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        if not stream:
            r = client.post(url + "/v1/chat/completions", json=body)
            if r.status_code != 200:
                return False, f"HTTP {r.status_code}: {r.text[:80]}", True, stream
            doc = r.json()
            choice = doc["choices"][0]
            why = _complete(choice.get("finish_reason"), doc.get("usage"), max_tokens)
            if why is None and isinstance(choice.get("message", {}).get("content"), str):
                return True, "ok", True, stream
            return False, f"incomplete answer: {why or 'no content'}", False, stream
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return False, f"HTTP {r.status_code}: {r.text[:80]}", True, stream
            finish = usage = None
            done = False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    return False, f"error event: {str(obj['error'])[:120]}", True, stream
                for ch in obj.get("choices") or []:
                    finish = ch.get("finish_reason") or finish
                usage = obj.get("usage") or usage
            why = _complete(finish, usage, max_tokens)
            if done and why is None:
                return True, "ok", True, stream
            return False, f"incomplete stream: {why or 'no [DONE]'}", False, stream
    except (httpx.HTTPError, OSError) as exc:
        return False, type(exc).__name__, True, stream
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # not the JSON expected
        return False, f"unreadable answer: {type(exc).__name__}: {exc}", False, stream


def client_loop(
    slot: EngineSlot, stop: threading.Event, rng: random.Random, out: list[RequestRecord]
) -> None:
    import httpx

    with httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        while not stop.is_set():
            if not slot.up.wait(0.2):
                continue
            inc = slot.current
            t0 = time.time()
            ok, reason, clear, stream = one_request(client, inc.url, slot.args.model, rng)
            out.append(
                RequestRecord(slot.index, inc.number, t0, time.time(), stream, ok, reason, clear)
            )
            if not ok:
                time.sleep(0.2)


# --- the faults ---------------------------------------------------------------------------------
@dataclass
class Chaos:
    store: str
    args: argparse.Namespace
    rng: random.Random
    workdir: Path
    collector: Collector
    proxy: TcpProxy
    slots: list[EngineSlot]
    pg: Any = None
    sqlite_path: str | None = None
    t0: float = field(default_factory=time.time)
    log: list[dict[str, Any]] = field(default_factory=list)

    def _hold(self, seconds: float, rec: dict[str, Any]) -> None:
        """Keep an outage for ``seconds``; with probability ``--overlap``, an engine kill or a
        connection cut lands in the middle of it."""
        if self.rng.random() >= self.args.overlap:
            time.sleep(seconds)
            return
        t = time.monotonic()
        time.sleep(self.rng.uniform(0.0, seconds))
        rec["during"] = self.inject(self.rng.choice(OVERLAPPING), nested=True)["kind"]
        time.sleep(max(0.0, seconds - (time.monotonic() - t)))

    def inject(self, kind: str, nested: bool = False) -> dict[str, Any]:
        a, rng = self.args, self.rng
        rec: dict[str, Any] = {"t_s": round(time.time() - self.t0, 2), "kind": kind}
        if nested:
            rec["overlapping"] = True
        t = time.monotonic()
        if kind == "store_lock":
            hold = a.busy_timeout_ms / 1000 + rng.uniform(0.5, a.hold_max_s)
            assert self.sqlite_path is not None
            locker = sqlite3.connect(self.sqlite_path, timeout=60, isolation_level=None)
            try:
                locker.execute("BEGIN EXCLUSIVE")
                self._hold(hold, rec)
                locker.execute("ROLLBACK")
            finally:
                locker.close()
            rec["held_s"] = round(hold, 2)
        elif kind == "postgres_restart":
            hold = rng.uniform(0.5, a.hold_max_s)
            self.pg.pause()
            self._hold(hold, rec)
            self.pg.resume()
            rec["down_s"] = round(hold, 2)
        elif kind == "collector_kill":
            down = rng.uniform(0.2, a.hold_max_s)
            self.collector.kill()
            self._hold(down, rec)
            self.collector.start()
            rec["down_s"] = round(down, 2)
        elif kind == "engine_kill":
            up = [s for s in self.slots if s.up.is_set()]
            if not up:
                for s in self.slots:
                    s.join_restart()
                up = [s for s in self.slots if s.up.is_set()]
            slot = rng.choice(up)
            inc = slot.kill()
            slot.restart_later(rng.uniform(0.2, 2.0))
            rec.update(
                engine=slot.engine_id,
                pid=inc.pid,
                last_seq_at_kill=inc.metrics.get("last_seq"),
                acked_seq_at_kill=inc.metrics.get("acked_seq"),
            )
        elif kind == "connection_cut":
            block = rng.uniform(0.0, a.hold_max_s)
            if not nested:  # engines still reconnecting after the last fault: wait for one
                deadline = time.monotonic() + 5.0
                while self.proxy.open_connections == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
            rec["connections_cut"] = self.proxy.cut(block_s=block)
            rec["blocked_s"] = round(block, 2)
            if not nested:
                time.sleep(block)
        elif kind == "disk_full":
            hold = rng.uniform(0.5, a.hold_max_s)
            rec["applied"] = self.collector.disk_full()
            self._hold(hold, rec)
            rec["freed"] = self.collector.disk_free()
            rec["held_s"] = round(hold, 2)
        else:
            raise ValueError(kind)
        rec["took_s"] = round(time.monotonic() - t, 2)
        self.log.append(rec)
        return rec

    def run(self, kinds: tuple[str, ...], duration: float, rounds: int) -> None:
        """Rounds of every kind in a seeded random order, a random pause before each fault,
        until ``duration`` has passed and at least ``rounds`` rounds were made."""
        done_rounds = 0
        end = time.monotonic() + duration
        while done_rounds < rounds or time.monotonic() < end:
            order = list(kinds)
            self.rng.shuffle(order)
            for kind in order:
                time.sleep(self.rng.uniform(self.args.pause_min_s, self.args.pause_max_s))
                self.collector.check_alive()
                rec = self.inject(kind)
                print(f"  [{self.store}] {rec}", flush=True)
            done_rounds += 1
            if done_rounds >= rounds and time.monotonic() >= end:
                break


# --- the audit ----------------------------------------------------------------------------------
def read_store(db_url: str) -> dict[str, Any]:
    """Every run, and per run key: data-row seqs (steps, request events, controls) and gaps."""
    from sqlalchemy import text

    from storage import db as dbm

    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            runs = [
                dict(r._mapping)
                for r in conn.execute(
                    text(
                        "SELECT id, engine_id, run_id, pid, last_seq, ended, "
                        "ended_without_goodbye, num_events, num_gap_events FROM runs ORDER BY id"
                    )
                )
            ]
            rows: dict[int, Counter[int]] = {r["id"]: Counter() for r in runs}
            steps: dict[int, list[tuple[int, int]]] = {}
            for key, seq, step in conn.execute(text("SELECT run_key, seq, step FROM steps")):
                rows.setdefault(key, Counter())[seq] += 1
                steps.setdefault(key, []).append((seq, step))
            for key, seq in conn.execute(text("SELECT run_key, seq FROM request_events")):
                rows.setdefault(key, Counter())[seq] += 1
            requests: dict[int, Counter[str]] = {}
            for key, finished in conn.execute(text("SELECT run_key, finished_ns FROM requests")):
                c = requests.setdefault(key, Counter())
                c["rows"] += 1
                c["unfinished"] += finished is None
            by_name = {(r["engine_id"], r["run_id"]): r["id"] for r in runs}
            for e, r, seq in conn.execute(
                text("SELECT engine_id, run_id, seq FROM controls WHERE seq IS NOT NULL")
            ):
                key = by_name.get((e, r))
                if key is not None:
                    rows.setdefault(key, Counter())[seq] += 1
            gaps: dict[int, list[dict[str, Any]]] = {}
            for g in conn.execute(
                text("SELECT run_key, seq, first_seq_lost, last_seq_lost, reason FROM gaps")
            ):
                gaps.setdefault(g[0], []).append(dict(g._mapping))
        return {"runs": runs, "rows": rows, "gaps": gaps, "steps": steps, "requests": requests}
    finally:
        db.dispose()


def gap_explained(reason: str | None, injected: set[str]) -> bool:
    """A gap's reason names a fault that was injected: a full engine buffer while
    acknowledgements had stopped (collector, store or network down)."""
    return bool(reason and reason.startswith("telemetry buffer full") and injected & ACK_STOPPING)


def step_order_violations(steps: list[tuple[int, int]]) -> int:
    """Step events whose step number is not above the one stored at the seq before (a resend
    that stored an event under another seq, or twice, would show here)."""
    ordered = [step for _, step in sorted(steps)]
    return sum(1 for a, b in zip(ordered, ordered[1:], strict=False) if b <= a)


def audit(
    store: dict[str, Any],
    slots: list[EngineSlot],
    injected: set[str],
    client_requests: Counter[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """Every run in ``store`` (``read_store``) against what its engine published (the
    incarnations of ``slots``); ``client_requests``: requests sent per (slot, incarnation)."""
    incs = {(s.engine_id, i.pid): i for s in slots for i in s.incarnations}
    seen: set[tuple[str, int]] = set()
    tot: Counter[str] = Counter()
    per_run = []
    problems: list[str] = []
    gap_reasons: Counter[tuple[str, bool]] = Counter()
    for run in store["runs"]:
        key = run["id"]
        inc = incs.get((run["engine_id"], run["pid"]))
        rows = store["rows"].get(key, Counter())
        gaps = store["gaps"].get(key, [])
        ranges = []
        gap_rows: Counter[int] = Counter()
        for g in gaps:
            gap_rows[g["seq"]] += 1
            first = g["first_seq_lost"] if g["first_seq_lost"] is not None else g["seq"]
            last = g["last_seq_lost"] if g["last_seq_lost"] is not None else g["seq"]
            ranges.append((first, last, g["reason"]))
            explained = gap_explained(g["reason"], injected)
            gap_reasons[((g["reason"] or "")[:160], explained)] += 1
            if not explained:
                problems.append(
                    f"run {run['run_id']}: gap seq {g['seq']} unexplained: {g['reason']!r}"
                )
        stored_last = int(run["last_seq"])
        info: dict[str, Any] = {
            "engine_id": run["engine_id"],
            "run_id": run["run_id"],
            "pid": run["pid"],
            "store_last_seq": stored_last,
            "ended": run["ended"] is not None,
            "ended_without_goodbye": bool(run["ended_without_goodbye"]),
        }
        goodbye = None
        lost_with_engine = 0
        if inc is None:
            published = stored_last
            upper = stored_last
            info["incarnation"] = None
            problems.append(
                f"run {run['run_id']} ({run['engine_id']}, pid {run['pid']}) "
                "matches no engine this run started"
            )
        else:
            seen.add((run["engine_id"], run["pid"]))
            last_seq = int(inc.metrics.get("last_seq", 0))
            acked = int(inc.metrics.get("acked_seq", 0))
            dropped = int(inc.metrics.get("events_dropped", 0))
            info.update(
                incarnation=inc.number,
                killed=inc.killed is not None,
                engine_last_seq=last_seq,
                engine_acked_seq=acked,
                engine_events_dropped=dropped,
                engine_events_spilled=int(inc.metrics.get("events_spilled", 0)),
            )
            if inc.killed is not None:
                # published: at least what the scrape before the kill saw; the store must hold
                # everything acknowledged by then
                published = max(last_seq, stored_last)
                upper = max(stored_last, acked)
                lost_with_engine = max(0, last_seq - stored_last)
                if stored_last < acked:
                    problems.append(
                        f"run {run['run_id']}: acknowledged up to {acked} before "
                        f"the kill, the store holds up to {stored_last}"
                    )
            else:
                # drained (acked == last_seq), then stopped: the goodbye is one more seq
                goodbye = last_seq + 1
                published = max(goodbye, stored_last)
                upper = published
                if run["ended"] is None:
                    problems.append(f"run {run['run_id']}: stopped with a goodbye, not ended")
                if inc.unacked_at_stop:
                    problems.append(f"run {run['run_id']}: {inc.unacked_at_stop}")
        c: Counter[str] = Counter()
        lost_seqs: list[int] = []
        for seq in range(1, upper + 1):
            declared = any(f <= seq <= last for f, last, _ in ranges)
            n = rows.get(seq, 0) + (0 if declared else gap_rows.get(seq, 0))
            if declared:
                c["declared_missing"] += 1
                if rows.get(seq, 0):
                    c["stored_and_declared"] += 1
            elif n == 1:
                c["stored"] += 1
            elif n > 1:
                c["duplicated"] += 1
            elif seq == goodbye and seq <= stored_last and run["ended"] is not None:
                c["stored"] += 1  # the goodbye: the run's end, not a row
            elif seq == stored_last and run["ended"] is not None and inc is None:
                c["stored"] += 1
            else:
                c["silently_lost"] += 1
                lost_seqs.append(seq)
        extra = [s for s in rows if s > upper]
        if extra:
            c["stored_beyond_published"] += len(extra)
        above = sorted(s for s in rows if s > stored_last)
        if above:
            # rows the run's durable seq says are not stored: the collector would answer a
            # hello with that seq, and the engine's resend of them could never be stored
            c["stored_above_durable_seq"] += len(above)
            problems.append(
                f"run {run['run_id']}: {len(above)} row(s) stored above the run's durable seq "
                f"{stored_last}, first {above[:5]}"
            )
        info.update(published=published, **c, lost_with_killed_engine=lost_with_engine)
        if lost_seqs:
            info["silently_lost_seqs"] = lost_seqs[:20]
            problems.append(
                f"run {run['run_id']}: {len(lost_seqs)} seq(s) silently lost, "
                f"first {lost_seqs[:10]}"
            )
        if c["duplicated"] or c["stored_and_declared"]:
            problems.append(
                f"run {run['run_id']}: {c['duplicated']} duplicated, "
                f"{c['stored_and_declared']} stored and declared lost"
            )
        if (
            inc is not None
            and inc.killed is None
            and c["declared_missing"] != info.get("engine_events_dropped", 0)
        ):
            problems.append(
                f"run {run['run_id']}: the engine dropped {info.get('engine_events_dropped')} "
                f"event(s), the store's gaps declare {c['declared_missing']}"
            )
        disorder = step_order_violations(store.get("steps", {}).get(key, []))
        if disorder:
            c["step_order_violations"] = disorder
            problems.append(f"run {run['run_id']}: {disorder} step event(s) out of seq order")
        reqs = store.get("requests", {}).get(key, Counter())
        info.update(store_requests=reqs["rows"], store_requests_unfinished=reqs["unfinished"])
        if inc is not None and inc.killed is None and not c["declared_missing"]:
            # stopped normally, nothing declared lost: every request the clients sent it is
            # in the store, finished
            sent = None if client_requests is None else client_requests[(inc.slot, inc.number)]
            info["client_requests"] = sent
            if (sent is not None and reqs["rows"] != sent) or reqs["unfinished"]:
                problems.append(
                    f"run {run['run_id']}: clients sent {sent} request(s), the store holds "
                    f"{reqs['rows']} ({reqs['unfinished']} unfinished)"
                )
        tot.update(c)
        tot["published"] += published
        tot["lost_with_killed_engine_at_least"] += lost_with_engine
        per_run.append(info)
    # an engine SIGKILLed before its run reached the store
    for (eid, pid), inc in incs.items():
        if (eid, pid) in seen:
            continue
        last_seq = int(inc.metrics.get("last_seq", 0))
        acked = int(inc.metrics.get("acked_seq", 0))
        per_run.append(
            {
                "engine_id": eid,
                "pid": pid,
                "run_id": None,
                "incarnation": inc.number,
                "killed": inc.killed is not None,
                "engine_last_seq": last_seq,
                "engine_acked_seq": acked,
                "published": last_seq,
                "lost_with_killed_engine": last_seq,
            }
        )
        tot["published"] += last_seq
        if inc.killed is None and last_seq:
            tot["silently_lost"] += last_seq
            problems.append(f"{eid} pid {pid}: stopped normally, no run in the store")
        else:
            tot["lost_with_killed_engine_at_least"] += last_seq
        if acked:
            tot["silently_lost"] += acked
            problems.append(f"{eid} pid {pid}: {acked} acknowledged, no run in the store")
    events = {
        k: int(tot.get(k, 0))
        for k in (
            "published",
            "stored",
            "declared_missing",
            "silently_lost",
            "duplicated",
            "stored_and_declared",
            "step_order_violations",
            "lost_with_killed_engine_at_least",
            "stored_beyond_published",
            "stored_above_durable_seq",
        )
    }
    return {
        "events": events,
        "gaps_by_reason": [
            {"reason": r, "explained": e, "count": n} for (r, e), n in sorted(gap_reasons.items())
        ],
        "runs": per_run,
        "problems": problems,
    }


def requests_summary(records: list[RequestRecord], slots: list[EngineSlot]) -> dict[str, Any]:
    kills = {(s.index, i.number): i.killed for s in slots for i in s.incarnations}
    by_reason: Counter[str] = Counter()
    unexplained: Counter[str] = Counter()
    unclear: Counter[str] = Counter()
    for r in records:
        if r.ok:
            continue
        killed = kills.get((r.slot, r.incarnation))
        r.explained = killed is not None and killed <= r.ended + 1.0
        by_reason[r.reason] += 1
        if not r.clear:
            unclear[r.reason] += 1
        if not r.explained:
            unexplained[r.reason] += 1
    ok = sum(r.ok for r in records)
    return {
        "total": len(records),
        "ok": ok,
        "ok_streamed": sum(r.ok and r.stream for r in records),
        "failed": len(records) - ok,
        "failed_by_reason": dict(by_reason),
        "failed_not_under_an_engine_kill": dict(unexplained),
        "unclear": dict(unclear),
    }


# --- one store ----------------------------------------------------------------------------------
def run_store(store: str, args: argparse.Namespace, pg: Any) -> dict[str, Any]:
    seed = args.seed * 1000 + (0 if store == "sqlite" else 1)
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix=f"chunkscope-chaos-{store}-"))
    if store == "sqlite":
        sqlite_path = str(workdir / "data" / "chunkscope.db")
        db_url = f"sqlite:///{sqlite_path}"
        kinds = SQLITE_KINDS
    else:
        sqlite_path = None
        db_url = pg.create_database()
        kinds = POSTGRES_KINDS
    extra = []
    if args.max_pending_bytes is not None:
        # a frame must fit the bound: the frame limit no larger (the publisher sends <= 1 MiB)
        frame = min(args.max_pending_bytes, 4 * 1024 * 1024)
        extra = [
            "--max-pending-bytes",
            str(args.max_pending_bytes),
            "--max-frame-bytes",
            str(frame),
        ]
    collector = Collector(db_url, workdir, args.busy_timeout_ms, extra)
    proxy: TcpProxy | None = None
    slots: list[EngineSlot] = []
    records: list[RequestRecord] = []
    stop = threading.Event()
    clients: list[threading.Thread] = []
    t_start = time.time()
    keep_dir = True  # an exception: keep the logs
    print(f"[{store}] workdir {workdir}", flush=True)
    try:
        collector.start()
        proxy = TcpProxy(collector.port).start()
        slots = [
            EngineSlot(i, args, f"ws://127.0.0.1:{proxy.port}", workdir)
            for i in range(args.engines)
        ]
        starters = [threading.Thread(target=s.start) for s in slots]
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if not all(s.up.is_set() for s in slots):
            raise RuntimeError(
                "an engine did not start: "
                + "; ".join(_tail(workdir / f"engine-{s.index}-0.log", 10) for s in slots)
            )
        for s in slots:
            for c in range(args.clients_per_engine):
                t = threading.Thread(
                    target=client_loop,
                    name=f"client-{s.index}-{c}",
                    args=(s, stop, random.Random(rng.random()), records),
                    daemon=True,
                )
                t.start()
                clients.append(t)
        chaos = Chaos(
            store, args, rng, workdir, collector, proxy, slots, pg=pg, sqlite_path=sqlite_path
        )
        chaos.run(kinds, args.duration, args.rounds)
        # every fault is cleared here (each is undone before the next); let restarts finish
        for s in slots:
            s.join_restart()
        collector.check_alive()
        time.sleep(1.0)
        stop.set()
        for t in clients:
            t.join(90)
        drained = {s.engine_id: s.drain(args.drain_timeout_s) for s in slots if s.up.is_set()}
        for s in slots:
            s.stop()
        collector_rc = collector.stop()
        sent = Counter((r.slot, r.incarnation) for r in records)
        result = audit(read_store(db_url), slots, {r["kind"] for r in chaos.log}, sent)
        reqs = requests_summary(records, slots)
        faults = Counter(r["kind"] for r in chaos.log)
        problems = result.pop("problems")
        problems += [
            f"{eid}: not drained in {args.drain_timeout_s} s"
            for eid, ok in drained.items()
            if not ok
        ]
        problems += [f"the collector exited on its own: {x}" for x in collector.unexpected_exits]
        problems += [f"{s.engine_id} did not restart: {e}" for s in slots for e in s.restart_errors]
        problems += [
            f"a fault was not applied or not undone: {r}"
            for r in chaos.log
            if r.get("applied") is False or r.get("freed") is False
        ]
        if reqs["unclear"]:
            problems.append(f"requests without a complete answer or clear error: {reqs['unclear']}")
        if reqs["failed_not_under_an_engine_kill"]:
            problems.append(
                f"requests failed with no engine kill under them: "
                f"{reqs['failed_not_under_an_engine_kill']}"
            )
        out = {
            "store": store,
            "db": "sqlite" if store == "sqlite" else "postgresql",
            "seed": seed,
            "wall_s": round(time.time() - t_start, 1),
            "engines": args.engines,
            "faults_injected": dict(faults),
            "faults_skipped": SKIPPED_KINDS[store],
            "fault_log": chaos.log,
            **result,
            "requests": reqs,
            "proxy": {
                "accepted": proxy.accepted,
                "refused": proxy.refused,
                "connections_cut": proxy.connections_cut,
            },
            "collector_starts": collector.starts,
            # frames refused by the collector's --max-pending-bytes (close 1013), from its log
            "frames_refused_busy": _log_count(collector.log, "closing 1013"),
            "collector_exit_code": collector_rc,
            "problems": problems,
            "ok": not problems,
        }
        keep_dir = args.keep_workdir or bool(problems)
        if keep_dir:
            out["workdir"] = str(workdir)
        return out
    finally:
        stop.set()
        for s in slots:
            s.join_restart(60)
            with contextlib.suppress(Exception):
                s.stop()
        with contextlib.suppress(Exception):
            collector.stop()
        if proxy is not None:
            proxy.stop()
        if not keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--store", choices=("sqlite", "postgres", "both"), default="both")
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of faults per store (default 600; --quick: 15, and at least --rounds rounds)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--clients-per-engine", type=int, default=2)
    ap.add_argument("--model", default="tiny", help="engine preset (tiny: fastest)")
    ap.add_argument(
        "--small-buffer-engines",
        type=int,
        default=1,
        help="this many engines keep few unacknowledged events (the next two options), so "
        "that outages overflow their buffer and they declare gaps; the others keep the "
        "publisher's defaults (20,000 events in memory, 1 GiB of spill)",
    )
    ap.add_argument("--small-buffer-events", type=int, default=200)
    ap.add_argument("--small-buffer-spill-bytes", type=int, default=32 * 1024)
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="at least this many faults of each kind (default 3; --quick: 2)",
    )
    ap.add_argument("--pause-min-s", type=float, default=None, help="default 2; --quick 0.3")
    ap.add_argument("--pause-max-s", type=float, default=None, help="default 10; --quick 1.5")
    ap.add_argument(
        "--hold-max-s",
        type=float,
        default=None,
        help="longest outage of one fault (default 6; --quick 2)",
    )
    ap.add_argument(
        "--busy-timeout-ms",
        type=int,
        default=None,
        help="the SQLite collector's busy timeout (default storage.db's 10000; "
        "--quick 1000); a store_lock holds the lock longer than it",
    )
    ap.add_argument(
        "--max-pending-bytes",
        type=int,
        default=None,
        help="the collector's --max-pending-bytes (default: its own, 128 MiB); a small one "
        "makes outages fill it, so refused frames (close 1013) and their resends are audited too",
    )
    ap.add_argument(
        "--overlap",
        type=float,
        default=0.3,
        help="probability that an engine kill or a connection cut lands in the middle of a "
        "store, collector or disk outage",
    )
    ap.add_argument("--drain-timeout-s", type=float, default=90.0)
    ap.add_argument(
        "--keep-workdir",
        action="store_true",
        help="keep the logs and SQLite files (default: kept only when a check fails)",
    )
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("duration", 600.0, 15.0),
        ("rounds", 3, 2),
        ("pause_min_s", 2.0, 0.3),
        ("pause_max_s", 10.0, 1.5),
        ("hold_max_s", 6.0, 2.0),
        ("busy_timeout_ms", 10_000, 1000),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    out_dir = setup(args)
    stores = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    results: dict[str, Any] = {}
    pg = None
    try:
        for store in stores:
            if store == "postgres":
                from testkit.postgres import PostgresServer, PostgresUnavailable

                try:
                    pg = PostgresServer.start()
                except PostgresUnavailable as exc:
                    results[store] = {"skipped": f"no PostgreSQL server here: {exc}"}
                    continue
            results[store] = run_store(store, args, pg)
            r = results[store]
            print(
                f"[{store}] faults {r['faults_injected']} events {r['events']} "
                f"requests ok {r['requests']['ok']} failed {r['requests']['failed']} "
                f"frames refused busy {r['frames_refused_busy']} ok={r['ok']}",
                flush=True,
            )
            for p in r["problems"]:
                print(f"[{store}] PROBLEM: {p}", flush=True)
    finally:
        if pg is not None:
            pg.stop()
    ran = [r for r in results.values() if "skipped" not in r]
    payload = {
        "stores": results,
        "silently_lost_total": sum(r["events"]["silently_lost"] for r in ran),
        "ok": bool(ran) and all(r["ok"] for r in ran),
    }
    write_json(out_dir / "chaos.json", payload, script=SCRIPT, config=config_of(args))
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
