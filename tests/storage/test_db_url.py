"""Database URLs with escaped characters in the password: the store opens and migrates, and no
message, error or log line shows the password."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pytest

from storage import db as dbm
from storage import export
from storage.cli import main as storage_main
from testkit.engines import FakeEngineClient, SyntheticEngine

from .helpers import stored_seqs

PASSWORD = "p@ss%w0rd:/x"  # as typed
ESCAPED = "p%40ss%25w0rd%3A%2Fx"  # as the URL holds it


def _with_password(url: str) -> str:
    scheme, rest = url.split("://", 1)
    user, host = rest.split("@", 1)
    return f"{scheme}://{user}:{ESCAPED}@{host}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_no_password(text: str) -> None:
    for secret in (PASSWORD, ESCAPED, "ss%w0rd", "ss%25w0rd"):
        assert secret not in text, f"the password shows in: {text[:2000]}"


def test_a_password_with_escaped_characters_migrates_and_serves(
    pg_server: Any, collector_factory: Any
) -> None:
    """The test server trusts every local connection, so the password is never checked: what is
    tested is that the URL, escapes and all, reaches the driver and the migrations."""
    url = _with_password(pg_server.create_database())
    db = dbm.connect(url)
    assert db.url.password == PASSWORD
    dbm.migrate(db)
    dbm.migrate(db)  # again: nothing to do
    assert dbm.current_revision(db) is not None
    db.dispose()
    col = collector_factory(url)
    eng = SyntheticEngine(engine_id="e", run_id="r", seed=1)
    client = FakeEngineClient(col.url, eng)
    client.connect()
    sent = eng.steps(3)
    client.send_events(sent)
    client.wait_ack(sent[-1]["seq"])
    client.close()
    assert stored_seqs(url, "e", "r") == list(range(1, eng.seq + 1))


def test_the_config_for_migrations_never_holds_the_password() -> None:
    db = dbm.connect(f"postgresql+psycopg://u:{ESCAPED}@127.0.0.1:1/db")
    cfg = dbm.alembic_config(db)
    _assert_no_password(str(cfg.get_main_option("sqlalchemy.url")))
    db.dispose()


def test_masked_url_hides_the_password_whether_or_not_the_url_parses() -> None:
    for url in (
        f"postgresql+psycopg://u:{ESCAPED}@host:5432/db",
        f"postgresql+psycopg://u:{ESCAPED}@host:notaport/db",
        f"postgres ql://u:{ESCAPED}@host/db",
        f"postgresql://u:{PASSWORD}@host/db",  # not escaped at all
    ):
        shown = dbm.masked_url(url)
        _assert_no_password(shown)
        assert "u:***@" in shown and "host" in shown
    assert dbm.masked_url("sqlite:///data/chunkscope.db") == "sqlite:///data/chunkscope.db"


def test_errors_and_logs_never_show_the_password(
    capsys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    nobody = f"postgresql+psycopg://u:{ESCAPED}@127.0.0.1:{_free_port()}/db"
    bad_port = f"postgresql+psycopg://u:{ESCAPED}@127.0.0.1:notaport/db"
    unparsable = f"postgres ql://u:{ESCAPED}@127.0.0.1/db"
    for url in (nobody, bad_port, unparsable):
        code = storage_main(["--port", "0", "--db", url, "--db-connect-timeout", "1"])
        assert code != 0
        code = storage_main(["prune", "--db", url, "--older-than", "7d", "--dry-run"])
        assert code != 0
        code = export.main(["--db", url, "--format", "csv", "--out", "/nonexistent/out"])
        assert code != 0
        with pytest.raises(ValueError) as info:
            if url is nobody:
                raise ValueError("parses")
            dbm.connect(url)
        _assert_no_password(str(info.value))
    out = capsys.readouterr()
    assert "u:***@" in out.err
    _assert_no_password(out.out + out.err + caplog.text)
