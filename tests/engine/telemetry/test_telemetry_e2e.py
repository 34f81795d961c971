"""End to end: a real ``tiny`` engine server (``python -m engine --collector-url``) -> the real
collector (``python -m storage``) -> SQLite -> ``storage.queries``; the collector SIGKILLed in the
middle of the run and restarted; the control relay back to the engine."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from storage import queries, schema
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector

ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 60.0
MAX_TOKENS = 12


class EngineServer:
    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "--model", "tiny", "--device", "cpu", "--port", "0",
             "--max-model-len", "256", "--log-level", "warning", *args],
            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        found: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if not found and line.startswith("chunkscope engine listening on "):
                    found.append(line.strip().rsplit(" ", 1)[-1])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(120)
        assert found, "engine server did not start:\n" + "".join(self.lines[-30:])
        self.url = found[0]
        self.http = httpx.Client(base_url=self.url, timeout=WAIT_S)

    def complete(self, prompt: str) -> dict[str, Any]:
        """One streamed completion; its token times from the chunkscope extension."""
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        ext: dict[str, Any] = {}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    chunk = json.loads(line[6:])
                    ext = {"id": chunk["id"], **chunk.get("chunkscope", {})}
        assert len(ext["token_times"]) == MAX_TOKENS
        return ext

    def run_batch(self, prompts: list[str]) -> list[dict[str, Any]]:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(self.complete, prompts))

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            m = re.match(r"^(chunkscope_telemetry_\w+)\{[^}]*\} (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_acked(self) -> dict[str, float]:
        deadline = time.monotonic() + WAIT_S
        while True:
            m = self.metrics()
            if m["chunkscope_telemetry_connected"] == 1 and (
                m["chunkscope_telemetry_acked_seq"] >= m["chunkscope_telemetry_last_seq"]
            ):
                return m
            assert time.monotonic() < deadline, f"telemetry not acknowledged: {m}"
            time.sleep(0.1)

    def scheduler(self) -> dict[str, Any]:
        return dict(self.http.get("/v1/scheduler").json())

    def stop(self) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return int(self.proc.returncode)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'telemetry.db'}"


@pytest.fixture
def collector(db_url: str) -> Iterator[CollectorProcess]:
    c = start_collector(db_url)
    yield c
    c.stop()


def test_round_trip_survives_a_collector_sigkill(
    tmp_path: Path, db_url: str, collector: CollectorProcess
) -> None:
    engine = EngineServer("--engine-id", "e2e", "--collector-url", collector.url,
                          "--telemetry-spill-dir", str(tmp_path / "spill"))  # fmt: skip
    restarted: CollectorProcess | None = None
    try:
        results = engine.run_batch([f"first batch {i}" for i in range(4)])
        engine.wait_acked()
        collector.kill()  # SIGKILL: no shutdown, no last commit
        results += engine.run_batch([f"collector down {i}" for i in range(4)])
        down = engine.metrics()
        assert down["chunkscope_telemetry_connected"] == 0
        assert down["chunkscope_telemetry_events_queued"] > 0
        assert down["chunkscope_telemetry_events_dropped_total"] == 0
        restarted = start_collector(db_url, args=["--port", str(collector.port)])
        results += engine.run_batch([f"collector back {i}" for i in range(4)])
        after = engine.wait_acked()
        assert after["chunkscope_telemetry_reconnects_total"] >= 1
        last_seq = int(after["chunkscope_telemetry_last_seq"])
        engine_steps = engine.scheduler()["step"]
        assert engine.stop() in (0, -signal.SIGINT)  # the goodbye is published before exit
    finally:
        engine.stop()
        if restarted is not None:
            restarted.stop()

    db = connect(db_url, readonly=True)
    with db.connect() as conn:  # every seq, the goodbye's included, stored exactly once
        row = conn.execute(
            select(schema.runs.c.last_seq, schema.runs.c.num_events).where(
                schema.runs.c.engine_id == "e2e"
            )
        ).one()
    assert tuple(row) == (last_seq + 1, last_seq + 1)
    steps = queries.steps(db, engine_id="e2e")
    assert sorted(steps["step"]) == list(range(engine_steps))  # every step, each once
    runs = queries.engines(db)
    run = runs[runs["engine_id"] == "e2e"].iloc[0]
    assert run["num_steps"] == engine_steps and run["num_gap_events"] == 0
    assert not run["ended_without_goodbye"] and run["ended"] is not None
    reqs = queries.requests(db, engine_id="e2e")
    assert sorted(reqs["request_id"]) == sorted(r["id"] for r in results)
    assert set(reqs["num_output_tokens"]) == {MAX_TOKENS}
    for r in results:  # the k-th token's time is the end of the step that produced it
        times = queries.token_times(db, engine_id="e2e", request_id=r["id"])
        assert list(times["k"]) == list(range(1, MAX_TOKENS + 1))  # k is 1-based
        assert list(times["time"]) == pytest.approx(r["token_times"], abs=1e-6)
        ends = steps.set_index("step").loc[list(times["step"]), "end_ns"]
        assert list(times["time_ns"]) == list(ends)


def test_control_relay_changes_the_real_engine(db_url: str, collector: CollectorProcess) -> None:
    from storage.control import send_control

    engine = EngineServer("--engine-id", "e2e-ctl", "--collector-url", collector.url,
                          "--token-budget", "64", "--max-token-budget", "1024")  # fmt: skip
    try:
        engine.wait_acked()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cli = subprocess.run(
            [sys.executable, "-m", "storage", "control", "--url", collector.url,
             "--engine", "e2e-ctl", "--token-budget", "512"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=WAIT_S,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        ack = json.loads(cli.stdout)
        assert ack["ok"] is True and ack["new"] == {"token_budget": 512}
        assert ack["old"] == {"token_budget": 64}
        assert engine.scheduler()["token_budget"] == 512
        for bad in (0, 10**9, "abc"):
            ack = send_control(collector.url, "e2e-ctl", {"token_budget": bad}, timeout=WAIT_S)
            assert ack["ok"] is False and "token_budget" in ack["error"], ack
            assert engine.scheduler()["token_budget"] == 512
        engine.run_batch(["after the change"])  # the accepted change is emitted before its step
        engine.wait_acked()
    finally:
        engine.stop()
    db = connect(db_url, readonly=True)
    controls = queries.controls(db, engine_id="e2e-ctl")
    accepted = controls[controls["accepted"]]
    assert list(accepted["new_value"]) == [512]
    assert len(controls[~controls["accepted"]]) >= 3


def test_an_engine_killed_mid_run_leaves_its_run_ended_without_goodbye(
    db_url: str, collector: CollectorProcess
) -> None:
    engine = EngineServer("--engine-id", "e2e-kill", "--collector-url", collector.url)
    try:
        engine.run_batch([f"before the kill {i}" for i in range(2)])
        engine.wait_acked()
        steps_before = engine.scheduler()["step"]
    finally:
        engine.proc.kill()  # SIGKILL: no goodbye
        engine.proc.wait(30)
        engine.http.close()
    db = connect(db_url, readonly=True)

    def ended() -> bool:
        runs = queries.engines(db)
        return bool(runs[runs["engine_id"] == "e2e-kill"]["ended_without_goodbye"].any())

    deadline = time.monotonic() + WAIT_S
    while not ended():
        assert time.monotonic() < deadline, "run not marked ended without goodbye"
        time.sleep(0.1)
    assert len(queries.steps(db, engine_id="e2e-kill")) == steps_before


def test_a_collector_that_never_answers_does_not_slow_serving() -> None:
    import socket

    with socket.socket() as hole:  # accepts TCP connections (backlog) but never speaks
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        port = hole.getsockname()[1]
        engine = EngineServer("--engine-id", "e2e-hole", "--collector-url",
                              f"ws://127.0.0.1:{port}")  # fmt: skip
        try:
            results = engine.run_batch([f"nobody listens {i}" for i in range(4)])
            assert [len(r["token_times"]) for r in results] == [MAX_TOKENS] * 4
            m = engine.metrics()
            assert m["chunkscope_telemetry_connected"] == 0
            assert m["chunkscope_telemetry_acked_seq"] == 0
            assert m["chunkscope_telemetry_events_queued"] == m["chunkscope_telemetry_last_seq"] > 0
            assert m["chunkscope_telemetry_events_dropped_total"] == 0
        finally:
            engine.stop()
