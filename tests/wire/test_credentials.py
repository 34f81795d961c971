"""wire.credentials: the loopback rule every service binds by."""

from __future__ import annotations

import pytest

from wire import credentials


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"])
def test_loopback(host: str) -> None:
    assert credentials.is_loopback(host)
    assert credentials.bind_refusal("x", host, {"--k": "y"}, allowed=False) == ""


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.2", "myhost", "127.0.0.1.nip.io"])
def test_not_loopback(host: str) -> None:
    assert not credentials.is_loopback(host)
    why = credentials.bind_refusal("svc", host, {"--k": "what it guards"}, allowed=False)
    assert "svc refuses" in why and "--k (what it guards)" in why
    assert credentials.bind_refusal("svc", host, {"--k": "y"}, allowed=True) == ""
    assert credentials.bind_refusal("svc", host, {}, allowed=False) == ""


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(credentials.LEGACY_ENV, "old")
    monkeypatch.setenv(credentials.PUBLISH_ENV, "")
    assert credentials.from_env(credentials.PUBLISH_ENV) is None
    assert credentials.from_env(credentials.PUBLISH_ENV, legacy=True) == "old"
    monkeypatch.setenv(credentials.PUBLISH_ENV, "new")
    assert credentials.from_env(credentials.PUBLISH_ENV, legacy=True) == "new"
