"""Publishing and steering are separate credentials on the collector (wire/credentials.py): the
publish token opens /ingest only, the control token /control only, and neither reaches a party
that does not need it; an engine listed in --credentials-file has tokens of its own. Loopback,
port 0."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from sqlalchemy import select
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from storage import cli, schema
from storage import db as dbm
from storage.control import CollectorUnavailable, list_engines, send_control
from testkit.engines import FakeEngineClient, SyntheticEngine
from wire import credentials
from wire.control import control_mac

from .helpers import hello_close_code, wait_until


def _hello_close_code(url: str, token: str | None) -> int | None:
    return _close_code(url, "e", token)


def test_publishing_and_steering_open_one_door_each(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(sqlite_url, publish_token="pub-1", control_token="ctl-1")
    assert _hello_close_code(collector.url, "pub-1") is None
    assert _hello_close_code(collector.url, None) == 4401
    assert _hello_close_code(collector.url, "ctl-1") == 4401  # steering does not publish
    for token in (None, "pub-1"):  # publishing does not steer, nor list
        with pytest.raises(CollectorUnavailable, match="401"):
            list_engines(collector.url, auth_token=token)
        with pytest.raises(InvalidStatus):
            connect(
                collector.url + "/control",
                additional_headers={"Authorization": f"Bearer {token}"},
                open_timeout=5,
                proxy=None,
            )
    assert [e["engine_id"] for e in list_engines(collector.url, auth_token="ctl-1")] == ["e"]
    ack = send_control(collector.url, "e", {"token_budget": 64}, auth_token="ctl-1")
    assert "not connected" in ack["error"]  # past the door; the engine has gone


def test_the_older_single_token_still_opens_both(collector_factory: Any, sqlite_url: str) -> None:
    collector = collector_factory(sqlite_url, auth_token="one")
    assert _hello_close_code(collector.url, "one") is None
    assert _hello_close_code(collector.url, "other") == 4401
    assert len(list_engines(collector.url, auth_token="one")) == 1
    with pytest.raises(CollectorUnavailable, match="401"):
        list_engines(collector.url)


@pytest.fixture
def no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No shared token from this shell's environment reaches the collector's command line."""
    for env in (credentials.PUBLISH_ENV, credentials.CONTROL_ENV, credentials.LEGACY_ENV):
        monkeypatch.delenv(env, raising=False)


@pytest.mark.parametrize(
    ("flags", "missing"),
    [
        ([], ["--publish-token", "--control-token"]),
        (["--publish-token", "p"], ["--control-token"]),
        (["--control-token", "c"], ["--publish-token"]),
    ],
)
def test_the_collector_refuses_a_network_address_without_both_tokens(
    flags: list[str],
    missing: list[str],
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    no_token_env: None,
) -> None:
    argv = ["--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path), *flags]
    assert cli.run_collector(argv) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in missing) and "--allow-unauthenticated" in err
    assert not any(tmp_path.iterdir())  # refused before a store was made


# ---- per-engine credentials (--credentials-file) -----------------------------------------------

OWN = {
    "a": credentials.EngineCredentials(publish="pub-a-own", control="ctl-a-own"),
    "b": credentials.EngineCredentials(publish="pub-b-own", control="ctl-b-own"),
}


def _close_code(url: str, engine_id: str, token: str | None) -> int | None:
    hello = SyntheticEngine(engine_id=engine_id, run_id=f"r-{token}").hello(token=token)
    return hello_close_code(url, hello)


def test_engine_a_s_publish_token_cannot_publish_as_engine_b(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(
        sqlite_url, publish_token="pub-shared", control_token="ctl-shared", engine_credentials=OWN
    )
    refused = collector.metrics.refusals.labels(reason="auth")
    assert _close_code(collector.url, "a", "pub-a-own") is None
    assert _close_code(collector.url, "b", "pub-b-own") is None
    before = refused._value.get()
    assert _close_code(collector.url, "b", "pub-a-own") == 4401  # A's token, B's name
    assert _close_code(collector.url, "b", "pub-shared") == 4401  # listed: its own token only
    assert _close_code(collector.url, "b", None) == 4401
    assert refused._value.get() == before + 3  # counted like every refusal
    assert _close_code(collector.url, "c", "pub-shared") is None  # unlisted: the shared one
    assert _close_code(collector.url, "c", "pub-a-own") == 4401
    stored = {e["engine_id"] for e in list_engines(collector.url, auth_token="ctl-shared")}
    assert stored == {"a", "b", "c"}


def test_engine_a_s_control_token_cannot_steer_engine_b(
    collector_factory: Any, sqlite_url: str
) -> None:
    collector = collector_factory(
        sqlite_url, publish_token="pub-shared", control_token="ctl-shared", engine_credentials=OWN
    )
    clients = {}
    for engine_id, token in (("a", "pub-a-own"), ("b", "pub-b-own"), ("c", "pub-shared")):
        eng = SyntheticEngine(engine_id=engine_id, run_id=f"run-{engine_id}", seed=3)
        client = FakeEngineClient(collector.url, eng, token=token)
        client.connect()
        client.send_events(eng.steps(2))
        client.wait_ack(eng.seq)
        clients[engine_id] = client
    try:
        # A's own token: past /control's door, but B is not A's to steer; nothing reaches B.
        ack = send_control(collector.url, "b", {"token_budget": 64}, auth_token="ctl-a-own")
        assert ack["ok"] is False and "control token for engine 'b'" in ack["error"]
        assert clients["b"].controls == [] and clients["b"].engine.token_budget == 512
        # the same token for an unlisted engine, and the shared token for a listed one: refused
        ack = send_control(collector.url, "c", {"token_budget": 64}, auth_token="ctl-a-own")
        assert ack["ok"] is False and clients["c"].controls == []
        ack = send_control(collector.url, "a", {"token_budget": 64}, auth_token="ctl-shared")
        assert ack["ok"] is False and clients["a"].controls == []
        # each token steers what it is for; the engine gets a MAC under its own token
        ack = send_control(collector.url, "a", {"token_budget": 64}, auth_token="ctl-a-own")
        assert ack["ok"] is True and clients["a"].engine.token_budget == 64
        relayed = clients["a"].controls[-1]
        assert relayed["mac"] == control_mac(
            "ctl-a-own", control_id=relayed["id"], engine_id="a", run_id="run-a",
            changes={"token_budget": 64},
        )  # fmt: skip
        ack = send_control(collector.url, "c", {"token_budget": 96}, auth_token="ctl-shared")
        assert ack["ok"] is True and clients["c"].engine.token_budget == 96
        # A's token lists A alone; the shared one lists every engine
        assert [e["engine_id"] for e in list_engines(collector.url, auth_token="ctl-a-own")] == [
            "a"
        ]
        listed = list_engines(collector.url, auth_token="ctl-shared")
        assert {e["engine_id"] for e in listed} == {"a", "b", "c"}
        # the refusal for B is stored, one row, with its reason
        rows = wait_until(
            lambda: [r for r in _control_rows(sqlite_url) if r["engine_id"] == "b"],
            what="the refused control stored",
        )
        assert len(rows) == 1 and not rows[0]["accepted"]
        assert "control token for engine 'b'" in rows[0]["reason"]
    finally:
        for client in clients.values():
            client.close()


def _control_rows(db_url: str) -> list[dict[str, Any]]:
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as c:
            return [dict(r._mapping) for r in c.execute(select(schema.controls))]
    finally:
        db.dispose()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ('[engines."a"]\npublish = "pub-a-own"\n', "engine 'a': missing control"),
        ('[engines."a"]\npublish = "pub-ä"\ncontrol = "ctl-a-own"\n', "printable ASCII"),
        (
            '[engines."a"]\npublish = "pub-a-own"\ncontrol = "ctl-a-own"\n'
            '[engines."a"]\npublish = "pub-a-2"\ncontrol = "ctl-a-2"\n',
            "not valid TOML",
        ),
        ('[engines."a"]\npublish = "pub-shared"\ncontrol = "ctl-a-own"\n', "equal to a shared"),
    ],
)
def test_a_bad_credentials_file_refuses_to_start_with_exit_2(
    content: str,
    why: str,
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_token_env: None,
) -> None:
    path = tmp_path / "creds.toml"
    path.write_text(content)
    data = tmp_path / "data"

    async def started(_self: Any) -> None:
        raise AssertionError("the collector started despite the bad file")

    monkeypatch.setattr("storage.collector.Collector.start", started)
    argv = ["--port", "0", "--data-dir", str(data), "--credentials-file", str(path)]
    assert cli.run_collector([*argv, "--publish-token", "pub-shared"]) == 2
    err = capsys.readouterr().err
    assert why in err and "--credentials-file" in err and "Traceback" not in err
    assert "pub-a-own" not in err and "ctl-a-own" not in err and "pub-ä" not in err
    assert not data.exists()  # refused before a store was made


def test_the_collector_process_exits_2_on_a_bad_credentials_file(tmp_path: Any) -> None:
    path = tmp_path / "creds.json"
    path.write_text('{"engines": {"a": {"publish": "pub-a-own"}}}')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHUNKSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "storage", "--port", "0", "--data-dir", str(tmp_path / "d")],
        env={**env, credentials.CREDENTIALS_FILE_ENV: str(path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"{path}: engine 'a': missing control" in done.stderr and "pub-a-own" not in done.stderr
