"""The control relay: control client -> collector -> engine -> back, every change stored once;
refusals leave the budget unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from storage import db as dbm
from storage import queries
from storage.control import CollectorUnavailable, list_engines, send_control
from testkit.collector import start_collector
from testkit.engines import FakeEngineClient, SyntheticEngine
from wire.control import control_mac

from .helpers import run_row, wait_until


def _engine(collector: Any, **kwargs: Any) -> tuple[SyntheticEngine, FakeEngineClient]:
    eng = SyntheticEngine(
        engine_id="engine-ctl", run_id="run-ctl", seed=11, max_token_budget=2048, **kwargs
    )
    client = FakeEngineClient(collector.url, eng)
    client.connect()
    client.send_events(eng.steps(3))
    client.wait_ack(eng.seq)
    return eng, client


def _controls(db_url: str) -> Any:
    db = dbm.connect(db_url, readonly=True)
    try:
        return queries.controls(db)
    finally:
        db.dispose()


def test_accepted_control_reaches_engine_and_is_stored_once(collector: Any, db_url: str) -> None:
    eng, client = _engine(collector)
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 256}, control_id="c1")
    assert ack == {
        "type": "control_ack",
        "id": "c1",
        "ok": True,
        "applied_at_step": 3,
        "old": {"token_budget": 512},
        "new": {"token_budget": 256},
    }
    assert eng.token_budget == 256
    assert [c["set"] for c in client.controls] == [{"token_budget": 256}]
    # the engine's own control event arrives in its stream, before the step it applies to
    client.send_events(eng.steps(2))
    client.wait_ack(eng.seq)
    client.close()
    ctl = _controls(db_url)
    assert len(ctl) == 1
    row = ctl.iloc[0]
    assert (row.key, row.old_value, row.new_value, bool(row.accepted)) == (
        "token_budget",
        512,
        256,
        True,
    )
    assert row.applied_at_step == 3 and row.request_id == "c1"
    assert row.applied_at == pytest.approx(eng.wall(_step_start(db_url, 3)))
    assert run_row(db_url, "engine-ctl", "run-ctl")["token_budget"] == 256


def test_a_step_event_from_before_an_accepted_control_does_not_undo_it(collector: Any) -> None:
    """Telemetry is batched, an ack is not: events of steps that ran the old budget can reach
    the collector after the control's ack. The engines row keeps the new budget (the autopilot
    reads it to tell its own moves from an operator's: a stale row paused it mid-burst)."""
    eng, client = _engine(collector)
    held = eng.steps(2)  # steps 3 and 4, at 512, still in the engine's publisher
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 256})
    assert ack["ok"] and ack["applied_at_step"] == 5, ack
    [row] = list_engines(collector.url)
    assert row["token_budget"] == 256
    client.send_events(held)
    client.wait_ack(held[-1]["seq"])
    [row] = list_engines(collector.url)
    assert row["token_budget"] == 256, row
    client.send_events(eng.steps(2))  # the control's event, then steps at 256
    client.wait_ack(eng.seq)
    [row] = list_engines(collector.url)
    assert row["token_budget"] == 256 and row["last_step"] == 6, row
    client.close()


def _step_start(db_url: str, step: int) -> int:
    db = dbm.connect(db_url, readonly=True)
    try:
        st = queries.steps(db)
        return int(st[st.step == step].start_ns.iloc[0])
    finally:
        db.dispose()


REFUSALS = [
    ({"token_budget": "512"}, "must be an integer"),
    ({"token_budget": True}, "must be an integer"),
    ({"token_budget": 0}, "from 1 to 2048"),
    ({"token_budget": 2049}, "from 1 to 2048"),
    ({"token_budget": 64, "policy": "fastest"}, "policy must be one of"),
    ({"long_prefill_token_threshold": "64"}, "must be an integer"),
    ({"long_prefill_token_threshold": -1}, "from 0 to 2048"),
    ({"long_prefill_token_threshold": 2049}, "from 0 to 2048"),
    ({"temperature": 1}, "unknown key"),
    ({}, "non-empty object"),
]


@pytest.mark.parametrize(
    ("changes", "why"), REFUSALS, ids=[r[1] + str(i) for i, r in enumerate(REFUSALS)]
)
def test_refused_by_collector_changes_nothing(
    collector_factory: Any, sqlite_url: str, changes: dict[str, Any], why: str
) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _engine(collector)
    ack = send_control(collector.url, "engine-ctl", changes, control_id="bad")
    assert ack["ok"] is False and why in ack["error"], ack
    assert client.controls == []  # never forwarded
    assert eng.token_budget == 512
    [listed] = list_engines(collector.url)
    assert listed["token_budget"] == 512 and listed["connected"] is True
    client.send_events(eng.steps(1))
    client.wait_ack(eng.seq)
    ctl = wait_until(
        lambda: len(_controls(sqlite_url)) >= 1 and _controls(sqlite_url),
        what="refusal stored",
    )
    assert len(ctl) == 1  # one row per refused message, whatever its number of keys
    assert set(ctl.source) == {"collector"} and not ctl.accepted.any()
    assert set(ctl.request_id) == {"bad"} and all(why in r for r in ctl.reason)
    client.close()
    assert run_row(sqlite_url, "engine-ctl", "run-ctl")["token_budget"] == 512


def test_unknown_and_disconnected_engines(collector: Any, db_url: str) -> None:
    ack = send_control(collector.url, "engine-nobody", {"token_budget": 64})
    assert ack["ok"] is False and "unknown engine" in ack["error"]
    eng, client = _engine(collector)
    client.close()
    wait_until(lambda: not list_engines(collector.url)[0]["connected"], what="disconnect seen")
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 64})
    assert ack["ok"] is False and "not connected" in ack["error"]
    ctl = wait_until(lambda: len(_controls(db_url)) >= 1 and _controls(db_url), what="stored")
    # A control for an engine never seen is answered and counted, not stored: a client cannot
    # make rows for engines that do not exist.
    assert list(ctl.engine_id) == ["engine-ctl"]
    assert run_row(db_url, "engine-ctl", "run-ctl")["token_budget"] == 512


def test_refused_by_engine_is_relayed(collector_factory: Any, sqlite_url: str) -> None:
    collector = collector_factory(sqlite_url)
    eng, client = _engine(collector)
    client.on_control = lambda m: {
        "type": "control_ack",
        "id": m["id"],
        "ok": False,
        "error": "control token required",
    }
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 100}, control_id="x")
    assert ack == {"type": "control_ack", "id": "x", "ok": False, "error": "control token required"}
    assert eng.token_budget == 512
    client.close()


def test_no_answer_times_out(collector_factory: Any, sqlite_url: str) -> None:
    collector = collector_factory(sqlite_url, control_timeout=0.3)
    eng, client = _engine(collector)
    client.on_control = lambda m: None  # an engine that never answers
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 100})
    assert ack["ok"] is False and "no answer" in ack["error"]
    ctl = wait_until(
        lambda: len(_controls(sqlite_url)) == 1 and _controls(sqlite_url), what="stored"
    )
    assert ctl.iloc[0].source == "collector"
    client.close()


def test_control_token(collector_factory: Any, sqlite_url: str) -> None:
    collector = collector_factory(sqlite_url, control_token="s3cret-tok")
    eng, client = _engine(collector)
    # Steering is closed at the door: no token, or a wrong one, opens no /control connection.
    for presented in (None, "nope", "s3cret-tok-"):
        with pytest.raises(CollectorUnavailable, match="401"):
            send_control(collector.url, "engine-ctl", {"token_budget": 100}, auth_token=presented)
    ack = send_control(
        collector.url, "engine-ctl", {"token_budget": 100}, auth_token="s3cret-tok", token="nope"
    )
    assert ack["ok"] is False and "control token" in ack["error"]  # a message's own token rules
    assert eng.token_budget == 512
    ack = send_control(collector.url, "engine-ctl", {"token_budget": 100}, auth_token="s3cret-tok")
    assert ack["ok"] is True and eng.token_budget == 100
    # Never the token itself to an engine connection: a MAC under it, bound to engine, run, id.
    relayed = client.controls[-1]
    assert "token" not in relayed and "s3cret" not in json.dumps(relayed)
    assert relayed["mac"] == control_mac(
        "s3cret-tok", control_id=relayed["id"], engine_id="engine-ctl", run_id="run-ctl",
        changes={"token_budget": 100},
    )  # fmt: skip
    client.close()


def test_list_engines_and_unknown_messages(collector: Any) -> None:
    from websockets.sync.client import connect

    eng, client = _engine(collector)
    [row] = list_engines(collector.url)
    assert row["engine_id"] == "engine-ctl" and row["run_id"] == "run-ctl"
    assert row["max_token_budget"] == 2048 and row["policy"] == "chunked"
    assert row["last_step"] == 2
    with connect(collector.url + "/control", open_timeout=10, proxy=None) as ws:
        ws.send("{nope")
        assert json.loads(ws.recv(timeout=10))["code"] == "bad_input"
        ws.send(json.dumps({"type": "reboot"}))
        assert json.loads(ws.recv(timeout=10))["code"] == "unknown_message"
    client.close()


def test_control_cli(tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    proc = start_collector(url)
    try:
        eng, client = _engine(proc)
        base = [sys.executable, "-m", "storage"]
        out = subprocess.run(
            [
                *base,
                "control",
                "--url",
                proc.url,
                "--engine",
                "engine-ctl",
                "--token-budget",
                "300",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["new"] == {"token_budget": 300}
        out = subprocess.run(
            [*base, "control", "--url", proc.url, "--engine", "engine-ctl", "--token-budget", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and json.loads(out.stdout)["ok"] is False
        out = subprocess.run(
            [*base, "engines", "--url", proc.url], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0
        assert json.loads(out.stdout.splitlines()[0])["token_budget"] == 300
        client.close()
    finally:
        assert proc.stop() == 0


def test_cap_relayed_stored_and_listed(collector: Any, db_url: str) -> None:
    """The long-prefill cap goes the budget's way: relayed, applied at a step, listed by the
    collector, stored as a control event and on every step after it with its capped chunks."""
    key = "long_prefill_token_threshold"
    eng, client = _engine(collector, prompt_tokens=(600, 900))
    assert list_engines(collector.url)[0][key] == 0
    ack = send_control(collector.url, "engine-ctl", {key: 64}, control_id="cap1")
    assert ack["ok"] is True and ack["new"] == {key: 64} and ack["applied_at_step"] == 3
    client.send_events(eng.steps(3))
    client.wait_ack(eng.seq)
    assert list_engines(collector.url)[0][key] == 64
    client.close()
    [row] = _controls(db_url).itertuples()
    assert (row.key, row.new_value, row.applied_at_step) == (key, 64, 3)
    db = dbm.connect(db_url, readonly=True)
    try:
        steps = queries.steps(db)
        chunks = queries.step_chunks(db, step_from=0, step_to=5)
    finally:
        db.dispose()
    assert steps.set_index("step")[key].to_dict() == {0: 0, 1: 0, 2: 0, 3: 64, 4: 64, 5: 64}
    capped = chunks[chunks.capped]
    assert len(capped) and (capped.step >= 3).all() and (capped.num_tokens == 64).all()
