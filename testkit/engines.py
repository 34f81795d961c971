"""Helpers for tests and benchmarks of anything that talks to the collector (no torch).

- ``SyntheticEngine``: a seeded stand-in for an engine's event stream (contract dicts, causal
  order, realistic chunk layouts), with the exact token times it produced kept as ground truth.
- ``FakeEngineClient``: a websockets client that speaks the ingest side of the contract (hello,
  event frames, acks, answering controls like the engine does).
- ``start_collector`` / ``CollectorProcess``: ``python -m storage --port 0`` as a subprocess on a
  given database, its URL read back from its first line; ``stop()`` ends it.
- ``collector_in_thread``: the same collector inside this process (faster for unit tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wire.events import SCHEMA_VERSION
from wire.ready import COLLECTOR_READY

# ---- synthetic engine -------------------------------------------------------------------------


@dataclass
class _Req:
    request_id: str
    traffic_class: str
    prompt: int
    output: int
    arrival_ns: int
    computed: int = 0
    produced: int = 0
    scheduled: bool = False


@dataclass
class SyntheticEngine:
    """Generates one run's events as the contract dicts, seq included.

    Each step: arrivals until ``concurrency`` requests are in the system, one decode token for
    every request past its prompt, then prompt chunks (oldest first) filling the rest of
    ``token_budget``; a chunk that completes a prompt produces the first token. A request
    finishes after ``output`` tokens. ``steps(n)`` returns the events of the next n steps in
    causal order (arrived / first_scheduled / control, step, first_token / finished).
    """

    engine_id: str = "engine-synthetic"
    run_id: str = "run-synthetic"
    seed: int = 0
    token_budget: int = 512
    max_token_budget: int = 16384
    policy: str = "chunked"
    concurrency: int = 16
    prompt_tokens: tuple[int, int] = (16, 400)
    output_tokens: tuple[int, int] = (4, 64)
    classes: tuple[str, ...] = ("chat", "rag", "vlm")
    step_ns: int = 20_000_000
    mono_ns: int = 1_000_000_000_000
    wall_ns: int | None = None
    kv_blocks_total: int = 4096
    seq: int = 0
    step: int = 0
    truth: dict[str, list[int]] = field(default_factory=dict)  # request_id -> token end_ns
    _rng: random.Random = field(init=False, repr=False)
    _reqs: list[_Req] = field(default_factory=list, repr=False)
    _next_id: int = 0
    _pending: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if self.wall_ns is None:
            self.wall_ns = time.time_ns()
        self._clock = (self.wall_ns, self.mono_ns)

    def hello(self, token: str | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "type": "hello",
            "engine_id": self.engine_id,
            "run_id": self.run_id,
            "model": "synthetic",
            "host": "localhost",
            "pid": os.getpid(),
            "policy": self.policy,
            "token_budget": self.token_budget,
            "max_token_budget": self.max_token_budget,
            "kv_blocks_total": self.kv_blocks_total,
            "block_size": 16,
            "config": {"preset": "synthetic", "seed": self.seed},
            "clock": {"wall_ns": self._clock[0], "mono_ns": self._clock[1]},
        }
        if token is not None:
            d["token"] = token
        return d

    def wall(self, t_ns: int) -> float:
        return (self._clock[0] + t_ns - self._clock[1]) / 1e9

    def _event(self, d: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        d["seq"] = self.seq
        return d

    def _request_event(self, kind: str, r: _Req, t_ns: int, step: int | None) -> dict[str, Any]:
        return self._event(
            {
                "type": "request",
                "kind": kind,
                "request_id": r.request_id,
                "time_ns": t_ns,
                "traffic_class": r.traffic_class,
                "num_prompt_tokens": r.prompt,
                "num_image_tokens": r.prompt // 2 if r.traffic_class == "vlm" else 0,
                "num_output_tokens": r.produced,
                "num_cached_tokens": 0,
                "finish_reason": "length" if kind == "finished" else None,
                "step": step,
            }
        )

    def control(
        self,
        key: str,
        new_value: Any,
        *,
        accepted: bool = True,
        reason: str | None = None,
        source: str = "api",
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """Queue a control event (applied at the next step when accepted); returns it."""
        old = getattr(self, key)
        if accepted:
            setattr(self, key, new_value)
        ev = self._event(
            {
                "type": "control",
                "key": key,
                "old_value": old,
                "new_value": new_value,
                "accepted": accepted,
                "time_ns": self.mono_ns,
                "source": source,
                "applied_at_step": self.step if accepted else None,
                "reason": reason,
                "request_id": request_id,
            }
        )
        self._pending.append(ev)
        return ev

    def gap(self, first: int, last: int, reason: str = "spill limit reached") -> dict[str, Any]:
        """Declare seqs first..last lost (they must not have been handed out) and skip them."""
        assert first == self.seq + 1 and last >= first
        self.seq = last
        ev = self._event(
            {
                "type": "gap",
                "first_seq_lost": first,
                "last_seq_lost": last,
                "num_events_lost": last - first + 1,
                "reason": reason,
                "time_ns": self.mono_ns,
            }
        )
        self._pending.append(ev)
        return ev

    def goodbye(self) -> dict[str, Any]:
        return self._event({"type": "goodbye", "time_ns": self.mono_ns})

    def steps(self, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _ in range(n):
            out.extend(self._one_step())
        return out

    def _one_step(self) -> list[dict[str, Any]]:
        rng = self._rng
        out, self._pending = self._pending, []
        start = self.mono_ns
        end = start + self.step_ns + rng.randrange(0, self.step_ns // 4 + 1)
        while len(self._reqs) < self.concurrency:
            r = _Req(
                request_id=f"req-{self.seed}-{self._next_id}",
                traffic_class=self.classes[self._next_id % len(self.classes)],
                prompt=rng.randint(*self.prompt_tokens),
                output=rng.randint(*self.output_tokens),
                arrival_ns=start - rng.randrange(0, self.step_ns),
            )
            self._next_id += 1
            self._reqs.append(r)
            self.truth[r.request_id] = []
            out.append(self._request_event("arrived", r, r.arrival_ns, None))
        budget = self.token_budget
        chunks: list[dict[str, Any]] = []
        decode = prefill = 0
        for r in self._reqs:
            if r.computed >= r.prompt and budget > 0:
                chunks.append(
                    {
                        "request_id": r.request_id,
                        "kind": "decode",
                        "start": r.prompt + r.produced - 1,
                        "num_tokens": 1,
                        "produced_token": True,
                    }
                )
                budget -= 1
                decode += 1
        for r in self._reqs:
            if r.computed < r.prompt and budget > 0:
                if self.policy == "unchunked" and r.prompt - r.computed > budget:
                    continue
                n = min(budget, r.prompt - r.computed)
                if not r.scheduled:
                    r.scheduled = True
                    out.append(self._request_event("first_scheduled", r, start, self.step))
                chunks.append(
                    {
                        "request_id": r.request_id,
                        "kind": "prefill",
                        "start": r.computed,
                        "num_tokens": n,
                        "produced_token": r.computed + n == r.prompt,
                    }
                )
                r.computed += n
                budget -= n
                prefill += n
        num_running = sum(1 for r in self._reqs if r.scheduled)
        out.append(
            self._event(
                {
                    "type": "step",
                    "step": self.step,
                    "start_ns": start,
                    "end_ns": end,
                    "forward_ns": (end - start) * 4 // 5,
                    "token_budget": self.token_budget,
                    "policy": self.policy,
                    "num_decode_tokens": decode,
                    "num_prefill_tokens": prefill,
                    "num_scheduled_tokens": decode + prefill,
                    "num_running": num_running,
                    "num_waiting": len(self._reqs) - num_running,
                    "kv_blocks_used": min(self.kv_blocks_total, num_running * 8),
                    "kv_blocks_total": self.kv_blocks_total,
                    "num_preemptions": 0,
                    "chunks": chunks,
                }
            )
        )
        done: list[_Req] = []
        by_id = {r.request_id: r for r in self._reqs}
        for c in chunks:
            if c["produced_token"]:
                r = by_id[c["request_id"]]
                r.produced += 1
                self.truth[r.request_id].append(end)
                if r.produced == 1:
                    out.append(self._request_event("first_token", r, end, self.step))
                if r.produced >= r.output:
                    done.append(r)
        for r in done:
            out.append(self._request_event("finished", r, end, self.step))
            self._reqs.remove(r)
        self.step += 1
        self.mono_ns = end + 100_000
        return out


def frames(
    engine: SyntheticEngine, events: list[dict[str, Any]], per_frame: int = 64
) -> list[dict[str, Any]]:
    """``events`` cut into ``events`` frames of at most ``per_frame`` events."""
    return [
        {
            "schema": SCHEMA_VERSION,
            "type": "events",
            "engine_id": engine.engine_id,
            "run_id": engine.run_id,
            "events": events[i : i + per_frame],
        }
        for i in range(0, len(events), per_frame)
    ]


# ---- a fake engine on the wire ----------------------------------------------------------------


class FakeEngineClient:
    """The engine side of ``/ingest`` over a websockets (sync) client.

    ``connect()`` sends the hello and returns the collector's first ack; ``send()`` sends one
    frame; a reader thread records acks (``acked``), errors (``errors``) and answers controls
    through ``on_control`` (default: apply them to the synthetic engine like the engine's
    ``PUT /v1/scheduler`` would, queueing the engine's own control event).
    """

    def __init__(
        self,
        url: str,
        engine: SyntheticEngine,
        *,
        token: str | None = None,
        on_control: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.engine = engine
        self.token = token
        self.on_control = on_control or self.apply_control
        self.acked = 0
        self.errors: list[dict[str, Any]] = []
        self.controls: list[dict[str, Any]] = []
        self.close_code: int | None = None
        self._cond = threading.Condition()
        self._ws: Any = None
        self._reader: threading.Thread | None = None

    def connect(self, timeout: float = 10.0) -> int:
        from websockets.sync.client import connect

        self._ws = connect(self.url + "/ingest", open_timeout=timeout, max_size=None, proxy=None)
        self._ws.__enter__()  # closed by close(); a context manager in websockets' terms
        self._ws.send(json.dumps(self.engine.hello(self.token)))
        first = json.loads(self._ws.recv(timeout=timeout))
        if first.get("type") != "ack":
            raise RuntimeError(f"expected an ack after the hello, got {first!r}")
        self.acked = int(first["seq"])
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self.acked

    def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            for raw in self._ws:
                msg = json.loads(raw)
                kind = msg.get("type")
                if kind == "ack":
                    with self._cond:
                        self.acked = max(self.acked, int(msg["seq"]))
                        self._cond.notify_all()
                elif kind == "control":
                    self.controls.append(msg)
                    reply = self.on_control(msg)
                    if reply is not None:
                        self._ws.send(json.dumps(reply))
                else:
                    with self._cond:
                        self.errors.append(msg)
                        self._cond.notify_all()
        except ConnectionClosed:
            pass
        finally:
            with self._cond:
                self.close_code = self._ws.close_code
                self._cond.notify_all()

    def apply_control(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer a relayed control as the engine would (checks, then both keys applied)."""
        eng = self.engine
        cid = msg.get("id")
        new = dict(msg.get("set") or {})
        for key, value in new.items():
            if key == "token_budget":
                ok = isinstance(value, int) and 1 <= value <= eng.max_token_budget
                why = f"token_budget must be from 1 to {eng.max_token_budget}, got {value!r}"
            elif key == "policy":
                ok, why = value in ("chunked", "unchunked"), f"bad policy {value!r}"
            else:
                ok, why = False, f"unknown key {key!r}"
            if not ok:
                eng.control(
                    key, value, accepted=False, reason=why, source="collector", request_id=cid
                )
                return {"type": "control_ack", "id": cid, "ok": False, "error": why}
        old = {key: getattr(eng, key) for key in new}
        for key, value in new.items():
            eng.control(key, value, source="collector", request_id=cid)
        return {
            "type": "control_ack",
            "id": cid,
            "ok": True,
            "applied_at_step": eng.step,
            "old": old,
            "new": new,
        }

    def send(self, frame: dict[str, Any] | str) -> None:
        self._ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    def send_events(self, events: list[dict[str, Any]], per_frame: int = 64) -> None:
        for frame in frames(self.engine, events, per_frame):
            self.send(frame)

    def wait_ack(self, seq: int, timeout: float = 10.0) -> int:
        """Wait until the collector has acked ``seq`` (or the connection closed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.acked < seq and self.close_code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no ack for seq {seq} within {timeout} s (acked {self.acked})"
                    )
                self._cond.wait(left)
            return self.acked

    def wait_error(self, timeout: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.errors and self.close_code is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no error reply within {timeout} s")
                self._cond.wait(left)
            if not self.errors:
                raise RuntimeError(f"connection closed ({self.close_code}) without an error")
            return self.errors.pop(0)

    def wait_closed(self, timeout: float = 10.0) -> int | None:
        if self._reader is not None:
            self._reader.join(timeout)
        return self.close_code

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
        if self._reader is not None:
            self._reader.join(10)


# ---- a collector to talk to -------------------------------------------------------------------


@dataclass
class CollectorProcess:
    """A collector subprocess: ``url`` (ws://127.0.0.1:PORT), ``db_url`` and the process."""

    url: str
    db_url: str
    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def http_url(self) -> str:
        return "http" + self.url[2:]

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last commit."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (a clean shutdown that writes what is queued), then SIGKILL if needed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return int(self.process.returncode)


def start_collector(
    db_url: str,
    *,
    args: list[str] | None = None,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> CollectorProcess:
    """``python -m storage --port 0 --db DB_URL [args]``; returns once it listens."""
    cmd = [sys.executable, "-m", "storage", "--port", "0", "--db", db_url, *(args or [])]
    root = Path(__file__).resolve().parent.parent
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root), full_env.get("PYTHONPATH", "")) if p
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        cwd=str(cwd or root),
    )
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = COLLECTOR_READY.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(timeout)
    if not found:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(
            f"collector did not start within {timeout} s: {cmd}\n" + "\n".join(lines[-30:])
        )
    return CollectorProcess(url=found[0], db_url=db_url, process=proc, lines=lines)


@contextlib.contextmanager
def collector_in_thread(db_url: str, **options: Any) -> Iterator[Any]:
    """A ``storage.collector.Collector`` on 127.0.0.1 port 0 in a background thread's event
    loop; yields it (``.url``, ``.port``). Options are ``CollectorConfig`` fields."""
    import asyncio

    from storage.collector import Collector, CollectorConfig

    config = CollectorConfig(db_url=db_url, host="127.0.0.1", port=0, **options)
    collector = Collector(config)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(collector.start())
        except BaseException as exc:  # surfaced to the caller below
            errors.append(exc)
            started.set()
            return
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="collector", daemon=True)
    thread.start()
    if not started.wait(60) or errors:
        raise RuntimeError(f"collector did not start: {errors[:1]}")
    try:
        yield collector
    finally:
        fut = asyncio.run_coroutine_threadsafe(collector.stop(), loop)
        fut.result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


# ---- a private PostgreSQL server --------------------------------------------------------------


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server could be started here (the message says why)."""


@dataclass
class PostgresServer:
    """A throwaway PostgreSQL server (``initdb`` + ``pg_ctl`` from Debian's packages) on
    127.0.0.1, trust authentication, data in a temporary folder; as the ``postgres`` OS user
    when running as root. ``create_database()`` returns a ``postgresql+psycopg://`` URL."""

    bindir: Path
    datadir: Path
    port: int
    as_user: str | None
    _count: int = 0

    @classmethod
    def start(cls, timeout: float = 60.0) -> PostgresServer:
        import shutil
        import socket
        import tempfile

        candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not candidates:
            found = shutil.which("initdb")
            if found is None:
                raise PostgresUnavailable(
                    "no initdb: install Debian's postgresql package (apt-get install postgresql)"
                )
            candidates = [Path(found)]
        bindir = candidates[-1].parent
        as_user = None
        if os.geteuid() == 0:
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise PostgresUnavailable("running as root and there is no postgres user") from exc
            as_user = "postgres"
        root = Path(tempfile.mkdtemp(prefix="chunkscope-pg-"))
        datadir = root / "data"
        if as_user is not None:
            os.chown(root, pw.pw_uid, pw.pw_gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = cls(bindir=bindir, datadir=datadir, port=port, as_user=as_user)
        try:
            server._run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(datadir),
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "--no-sync",
                    "-E",
                    "UTF8",
                ],
                timeout,
            )
            opts = (
                f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            server._run(
                [
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(datadir),
                    "-o",
                    opts,
                    "-l",
                    str(root / "server.log"),
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "start",
                ],
                timeout + 10,
            )
        except PostgresUnavailable:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return server

    def _run(self, cmd: list[str], timeout: float) -> None:
        if self.as_user is not None:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresUnavailable(f"{cmd[0]} failed: {exc}") from exc
        if proc.returncode != 0:
            log = self.datadir.parent / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise PostgresUnavailable(
                f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}{tail}"
            )

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def create_database(self, name: str | None = None) -> str:
        import psycopg

        self._count += 1
        name = name or f"chunkscope_{os.getpid()}_{self._count}"
        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        import shutil

        try:
            self._run(
                [
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ],
                60,
            )
        finally:
            shutil.rmtree(self.datadir.parent, ignore_errors=True)
