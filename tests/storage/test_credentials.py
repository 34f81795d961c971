"""Publishing and steering are separate credentials on the collector (wire/credentials.py): the
publish token opens /ingest only, the control token /control only, and neither reaches a party
that does not need it. Loopback, port 0."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from storage import cli
from storage.control import CollectorUnavailable, list_engines, send_control
from testkit.engines import SyntheticEngine
from wire import credentials


def _hello_close_code(url: str, token: str | None) -> int | None:
    hello = SyntheticEngine(engine_id="e", run_id=f"r-{token}").hello(token=token)
    with connect(url + "/ingest", open_timeout=5, proxy=None) as ws:
        ws.send(json.dumps(hello))
        try:
            reply = json.loads(ws.recv(timeout=5))
        except ConnectionClosed:
            return ws.close_code
        assert reply["type"] == "ack", reply
        return None


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
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for env in (credentials.PUBLISH_ENV, credentials.CONTROL_ENV, credentials.LEGACY_ENV):
        monkeypatch.delenv(env, raising=False)
    argv = ["--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path), *flags]
    assert cli.run_collector(argv) == 2
    err = capsys.readouterr().err
    assert all(flag in err for flag in missing) and "--allow-unauthenticated" in err
    assert not any(tmp_path.iterdir())  # refused before a store was made
