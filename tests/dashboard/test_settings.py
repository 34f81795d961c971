"""Dashboard settings: embedded by default, attach mode by flags or environment."""

from __future__ import annotations

import pytest

from dashboard.settings import DEFAULT_MODEL, parse_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("COLLECTOR_URL", "DB_URL", "ENGINE_URL", "DATA_DIR", "MODEL", "TOKEN_BUDGET"):
        monkeypatch.delenv(f"CHUNKSCOPE_{k}", raising=False)


def test_default_is_embedded(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = parse_settings([])
    assert s.embedded and s.model == DEFAULT_MODEL
    assert s.data_dir == tmp_path / "data"


def test_attach_by_flags() -> None:
    s = parse_settings(["--collector", "ws://127.0.0.1:9000", "--db", "sqlite:////tmp/x.db"])
    assert not s.embedded
    assert (s.collector_url, s.db_url) == ("ws://127.0.0.1:9000", "sqlite:////tmp/x.db")


def test_attach_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", "ws://h:1")
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", "postgresql+psycopg://u@h/db")
    s = parse_settings(None)
    assert not s.embedded and s.db_url == "postgresql+psycopg://u@h/db"


def test_store_alone_is_read_only_attach() -> None:
    s = parse_settings(["--db", "sqlite:////tmp/x.db"])
    assert not s.embedded and s.collector_url is None


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--collector", "ws://h:1"], "needs the store too"),
        (["--collector", "h:1", "--db", "sqlite://"], "ws://HOST:PORT"),
        (["--token-budget", "0"], "from 1 to --max-token-budget"),
    ],
)
def test_bad_settings_say_why(argv: list[str], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_settings(argv)
