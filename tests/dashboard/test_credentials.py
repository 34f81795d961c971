"""The dashboard passes every credential it is given to the children and clients that need it,
and no other (issue 18); it serves on loopback only unless told otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from advisor import autopilot_run
from dashboard import autopilot, control, services
from dashboard.settings import bind_refusal, parse_settings
from storage import cli as storage_cli
from storage.control import CollectorUnavailable
from testkit.collector import collector_in_thread
from wire import credentials

SECRETS = {
    credentials.PUBLISH_ENV: "pub-x",
    credentials.CONTROL_ENV: "ctl-x",
    credentials.API_KEY_ENV: "api-x",
}


class _Recorder:
    """Stands in for ManagedProcess: records each child's name and environment."""

    started: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, name: str, argv: list[str], log: Path, nice: int = 0) -> None:
        self.name, self.argv = name, argv

    def start(self, env: dict[str, Any] | None = None) -> _Recorder:
        self.started.append((self.name, dict(env or {})))
        return self

    def wait_ready(self, _pattern: Any, _timeout: float) -> str:
        return "ws://127.0.0.1:1" if self.name == "collector" else "http://127.0.0.1:2"

    def alive(self) -> bool:
        return True


def test_each_child_gets_the_credentials_it_needs_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in SECRETS.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv(credentials.LEGACY_ENV, "legacy")
    monkeypatch.setenv("OPENAI_API_KEY", "openai-x")
    monkeypatch.setattr(services, "ManagedProcess", _Recorder)
    _Recorder.started = []
    settings = parse_settings(["--data-dir", str(tmp_path)])
    stack = services.Stack(settings).start()
    assert stack.wait_started(30) and stack.error is None, stack.error
    envs = dict(_Recorder.started)
    collector, engine = envs["collector"], envs["engine"]
    assert collector[credentials.PUBLISH_ENV] == "pub-x"
    assert collector[credentials.CONTROL_ENV] == "ctl-x"
    assert engine[credentials.PUBLISH_ENV] == "pub-x"
    assert engine[credentials.CONTROL_ENV] == "ctl-x"
    assert engine[credentials.API_KEY_ENV] == "api-x"
    # removed (None), not inherited: the collector never serves OpenAI routes
    assert collector[credentials.API_KEY_ENV] is None and collector["OPENAI_API_KEY"] is None
    assert collector[credentials.LEGACY_ENV] is None and engine[credentials.LEGACY_ENV] is None
    # the store's URL in the collector's environment; the engine never reads the store
    assert (
        collector[credentials.DB_URL_ENV] == stack.db_url and engine[credentials.DB_URL_ENV] is None
    )
    assert "--db" not in stack.collector.argv  # type: ignore[union-attr]
    shown = " ".join(stack.collector.argv + stack.engine.argv)  # type: ignore[union-attr]
    assert not any(v in shown for v in SECRETS.values())  # never on a command line
    # the traffic launcher's loadgen gets the API key, and nothing that steers or publishes
    launcher = services.TrafficLauncher(tmp_path)
    launcher.start("http://127.0.0.1:2", "chat", rate=1, duration=1, api_key="api-x")
    name, env = _Recorder.started[-1]
    assert name == "loadgen" and env["OPENAI_API_KEY"] == "api-x"
    assert env[credentials.CONTROL_ENV] is None and env[credentials.PUBLISH_ENV] is None
    assert "api-x" not in launcher.run.argv  # type: ignore[union-attr]


def test_the_dashboard_steers_with_its_control_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    with collector_in_thread(url, control_token="ctl-x", publish_token="pub-x") as collector:
        with pytest.raises(CollectorUnavailable, match="401"):
            control.list_engines(collector.url)
        assert control.list_engines(collector.url, token="ctl-x") == []
        res = control.set_scheduler(collector.url, "nobody", token_budget=64, token="ctl-x")
        assert not res.ok and "unknown engine" in (res.error or "")  # past the door


@pytest.mark.parametrize(
    ("address", "allowed", "refused"),
    [
        ("127.0.0.1", False, False),
        ("localhost", False, False),
        (None, False, True),  # Streamlit's default: every interface
        ("0.0.0.0", False, True),
        ("0.0.0.0", True, False),
    ],
)
def test_the_dashboard_serves_on_loopback_unless_told(
    address: str | None, allowed: bool, refused: bool
) -> None:
    settings = parse_settings(["--allow-unauthenticated"] if allowed else [])
    why = bind_refusal(address, settings)
    assert bool(why) is refused
    if refused:
        assert "--server.address 127.0.0.1" in why and "--allow-unauthenticated" in why


def test_settings_never_show_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in SECRETS.items():
        monkeypatch.setenv(var, value)
    settings = parse_settings([])
    assert settings.api_key == "api-x" and settings.publish_token == "pub-x"
    assert not any(v in repr(settings) for v in SECRETS.values())


def test_no_child_carries_the_store_password_on_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PostgreSQL URL holds its password; ps shows every local user a command line, so the
    autopilot child (the one child attach mode starts with the store) gets it in its
    environment, and its CLI reads it from there."""
    url = "postgresql+psycopg://chunk:s3cr%40t-pw@127.0.0.1:5432/chunkscope"
    monkeypatch.setattr(autopilot, "ManagedProcess", _Recorder)
    _Recorder.started = []
    switch = autopilot.AutopilotSwitch(tmp_path)
    proc = switch.start("ws://127.0.0.1:1", "e1", url, autopilot.SwitchSlo(250, 2000), token="t")
    argv = proc.argv  # type: ignore[attr-defined]
    assert not any("s3cr" in a for a in argv) and "--db" not in argv
    name, env = _Recorder.started[-1]
    assert name == "autopilot" and env[credentials.DB_URL_ENV] == url
    monkeypatch.setenv(credentials.DB_URL_ENV, url)  # as the child's environment holds it
    assert autopilot_run.build_parser().parse_args(argv[3:]).db == url
    # the collector's and the store commands' --db fall back to it as well
    assert storage_cli._collector_parser().parse_args([]).db == url
    monkeypatch.delenv(credentials.DB_URL_ENV)
    assert storage_cli._collector_parser().parse_args([]).db is None
