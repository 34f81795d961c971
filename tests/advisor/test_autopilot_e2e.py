"""End to end: ``chunkscope autopilot`` beside a real collector steering a real ``tiny`` engine:
its statuses are stored with source ``autopilot``, a manual control wins and pauses it, and
switching it off leaves the engine where it was, stored as such."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from advisor.traffic import engine_shape
from storage import queries
from storage.control import send_control
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector
from tests.engine.telemetry.test_telemetry_e2e import EngineServer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'ap.db'}"


@pytest.fixture
def collector(db_url: str) -> Iterator[CollectorProcess]:
    c = start_collector(db_url)
    yield c
    c.stop()


def autopilot(collector: CollectorProcess, db_url: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "chunkscope.cli", "autopilot", "--collector", collector.url,
         "--engine", "ap", "--db", db_url, "--slo-itl-ms", "1000", "--slo-ttft-ms", "5000",
         "--interval", "0.5", "--lookback", "60", "--budgets", "64,256", "--caps", "0,32",
         "--status-every", "0.5", "--log", str(log), "--log-level", "warning"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def wait_lines(path: Path, n: int, proc: subprocess.Popen[str], timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [json.loads(x) for x in lines]
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} decisions in {timeout} s")


def test_autopilot_through_a_real_collector(
    db_url: str, collector: CollectorProcess, tmp_path: Path
) -> None:
    engine = EngineServer("--engine-id", "ap", "--collector-url", collector.url,
                          "--token-budget", "64", "--max-token-budget", "1024")  # fmt: skip
    try:
        engine.run_batch([f"request {i} " * 8 for i in range(6)])
        engine.wait_acked()
        log = tmp_path / "decisions.jsonl"
        ap = autopilot(collector, db_url, log)
        decisions = wait_lines(log, 2, ap)
        assert {d["kind"] for d in decisions} <= {"change", "hold", "refuse", "fallback"}
        # the operator steps in: the manual control wins and pauses the autopilot
        ack = send_control(collector.url, "ap", {"token_budget": 128}, timeout=20)
        assert ack["ok"], ack
        assert ap.wait(20) == 3, ap.communicate()[0]
        assert engine.scheduler()["token_budget"] == 128
        # switched on again, then off: the engine stays where it was
        log2 = tmp_path / "again.jsonl"
        ap2 = autopilot(collector, db_url, log2)
        wait_lines(log2, 1, ap2)
        ap2.send_signal(signal.SIGTERM)
        assert ap2.wait(20) == 0, ap2.communicate()[0]
        budget = engine.scheduler()["token_budget"]
        max_model_len = engine.http.get("/v1/models").json()["data"][0]["max_model_len"]
        engine.run_batch(["after"])
        engine.wait_acked()
    finally:
        engine.stop()
    db = connect(db_url, readonly=True)
    # the hello carries the max_model_len in force (the probe's default length), not the
    # config's None
    assert engine_shape(db, engine_id="ap").max_model_len == max_model_len
    c = queries.controls(db, engine_id="ap")
    mine = c[c["source"] == "autopilot"]
    reasons = list(mine["reason"])
    assert any(r.startswith("autopilot on:") for r in reasons), reasons
    assert any(r.startswith("autopilot paused: a manual control") for r in reasons), reasons
    assert reasons[-1] == f"autopilot off: engine left at budget {budget} cap off", reasons
    manual = c[(c["source"] != "autopilot") & c["accepted"]]
    assert list(manual["new_value"]) == [128]
    # a status is a control event with no change
    status = mine[mine["reason"].str.startswith("autopilot on:")]
    assert (status["old_value"] == status["new_value"]).all()
