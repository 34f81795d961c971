"""wire.credentials: the loopback rule every service binds by, and per-engine credentials."""

from __future__ import annotations

import functools
from typing import Any

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


# ---- per-engine credentials (--credentials-file) -----------------------------------------------

GOOD_TOML = """
[engines."a"]
publish = "pub-a-0001"
control = "ctl-a-0001"

[engines."b/2"]
publish = "pub-b-0002"
control = "ctl-b-0002"
"""


def test_a_credentials_file_in_toml_or_json() -> None:
    engines = credentials.parse_engine_credentials(GOOD_TOML, toml=True)
    assert engines == {
        "a": credentials.EngineCredentials("pub-a-0001", "ctl-a-0001"),
        "b/2": credentials.EngineCredentials("pub-b-0002", "ctl-b-0002"),
    }
    as_json = '{"engines": {"a": {"publish": "pub-a-0001", "control": "ctl-a-0001"}}}'
    assert credentials.parse_engine_credentials(as_json, toml=False) == {"a": engines["a"]}
    assert "pub-a" not in repr(engines)  # never printed by accident


@pytest.mark.parametrize(
    ("text", "toml", "why"),
    [
        ('[engines."a"]\npublish = "p-1"\n', True, "engine 'a': missing control"),
        ('[engines."a"]\ncontrol = "c-1"\n', True, "engine 'a': missing publish"),
        ('[engines."a"]\npublish = "p-1"\ncontrol = "c-1"\nrole = "x"\n', True, "unknown field"),
        ('[engines."a"]\npublish = "pé-1"\ncontrol = "c-1"\n', True, "publish must be printable"),
        ('[engines."a"]\npublish = "p 1"\ncontrol = "c-1"\n', True, "without spaces"),
        ('[engines."a"]\npublish = ""\ncontrol = "c-1"\n', True, "non-empty string"),
        ('[engines."a"]\npublish = 7\ncontrol = "c-1"\n', True, "non-empty string"),
        ('[engines."a"]\npublish = "same"\ncontrol = "same"\n', True, "used twice"),
        (
            '[engines."a"]\npublish = "p-1"\ncontrol = "c-1"\n'
            '[engines."b"]\npublish = "p-1"\ncontrol = "c-2"\n',
            True,
            "engine 'b': its publish token is used twice",
        ),
        (
            '[engines."a"]\npublish = "p-1"\ncontrol = "c-1"\n'
            '[engines."a"]\npublish = "p-2"\ncontrol = "c-2"\n',
            True,
            "not valid TOML",
        ),
        (
            '{"engines": {"a": {"publish": "p-1", "control": "c-1"}, '
            '"a": {"publish": "p-2", "control": "c-2"}}}',
            False,
            "'a' appears twice",
        ),
        ('{"engines": {"a": {"publish": "p-1", "control": "c-1"}', False, "not valid JSON"),
        ('publish = "p-1"\n', True, "one table 'engines'"),
        ('[engines."a"]\npublish = "p-1"\ncontrol = "c-1"\n[other]\n', True, "one table"),
        ('[engines]\na = "p-1"\n', True, "expected a table"),
        ('[engines."a\\u0007"]\npublish = "p-1"\ncontrol = "c-1"\n', True, "must be printable"),
    ],
)
def test_a_bad_credentials_file_says_what_is_wrong_and_never_a_token(
    text: str, toml: bool, why: str
) -> None:
    with pytest.raises(credentials.CredentialsFileError, match=why) as info:
        credentials.parse_engine_credentials(text, toml=toml)
    for secret in ("p-1", "p-2", "c-1", "c-2", "same", "pé-1"):
        assert secret not in str(info.value)


def test_load_names_the_file(tmp_path: Any) -> None:
    path = tmp_path / "creds.toml"
    path.write_text(GOOD_TOML)
    assert set(credentials.load_engine_credentials(path)) == {"a", "b/2"}
    (tmp_path / "creds.json").write_bytes(b"\xff\xfe")
    with pytest.raises(credentials.CredentialsFileError, match="creds.json: not UTF-8"):
        credentials.load_engine_credentials(tmp_path / "creds.json")
    with pytest.raises(credentials.CredentialsFileError, match="nope.toml: cannot read it"):
        credentials.load_engine_credentials(tmp_path / "nope.toml")


def test_a_listed_engine_publishes_and_is_steered_with_its_own_tokens_only() -> None:
    engines = credentials.parse_engine_credentials(GOOD_TOML, toml=True)
    publish = functools.partial(credentials.may_publish, shared="pub-shared", engines=engines)
    assert publish("a", "pub-a-0001") == ""
    assert "engine 'b/2'" in publish("b/2", "pub-a-0001")  # A's token does not publish as B
    assert publish("b/2", "pub-shared") != ""  # nor does the shared one, for a listed engine
    assert publish("c", "pub-shared") == "" and publish("c", "pub-a-0001") != ""
    assert publish("a", None) != "" and publish("a", 1) != "" and publish("a", "pub-a-0001é")
    steer = functools.partial(credentials.may_steer, shared="ctl-shared", engines=engines)
    assert steer("a", "ctl-a-0001") == ""
    assert "engine 'b/2'" in steer("b/2", "ctl-a-0001")  # A's token does not steer B
    assert steer("a", "pub-a-0001") != ""  # publishing does not steer
    assert steer("a", "ctl-shared") != "" and steer("c", "ctl-shared") == ""
    assert steer("c", "ctl-a-0001") != ""
    # no shared token: unlisted engines as without credentials, listed ones still their own
    assert credentials.may_steer("c", None, shared=None, engines=engines) == ""
    assert credentials.may_publish("a", None, shared=None, engines=engines) != ""
    assert credentials.steers_only("ctl-b-0002", engines) == "b/2"
    assert credentials.steers_only("ctl-shared", engines) is None
    assert credentials.clash_with_shared(engines, ["ctl-shared", None]) == ""
    assert "engine 'a'" in credentials.clash_with_shared(engines, ["ctl-a-0001"])
