"""Migrations under operations: a store written by a newer chunkscope, two collectors migrating
one empty store at once, and the PostgreSQL timeouts."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from storage import db as dbm
from storage.cli import main as storage_main


def test_a_store_at_an_unknown_revision_is_refused_before_any_change(db_url: str) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    with db.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))
    with pytest.raises(dbm.SchemaTooNew, match="0099_from_the_future.*newer chunkscope"):
        dbm.migrate(db)
    assert dbm.current_revision(db) == "0099_from_the_future"  # untouched
    db.dispose()


def test_the_collector_exits_2_with_a_message_not_a_traceback(tmp_path: Any, capsys: Any) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    db = dbm.connect(url)
    dbm.migrate(db)
    with db.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0099_from_the_future'"))
    db.dispose()
    assert storage_main(["--port", "0", "--db", url]) == 2
    err = capsys.readouterr().err
    assert "0099_from_the_future" in err and "Upgrade chunkscope" in err
    assert "Traceback" not in err


def _migrate_at_once(url: str, n: int = 3) -> list[BaseException]:
    """``n`` threads, each with its own engine, migrate ``url`` at the same moment."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    engines = [dbm.connect(url) for _ in range(n)]

    def one(db: Any) -> None:
        try:
            barrier.wait(10)
            dbm.migrate(db)
        except BaseException as exc:  # noqa: BLE001 - collected for the assert
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(db,)) for db in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for db in engines:
        db.dispose()
    return errors


def test_collectors_migrating_one_empty_store_at_once_are_safe(db_url: str) -> None:
    # planted: without the advisory lock (PostgreSQL) / file lock (SQLite) the racers fail with
    # "relation/table alembic_version already exists" or a duplicate key
    for _ in range(2):  # the race is a race: two rounds on fresh stores
        errors = _migrate_at_once(db_url)
        assert errors == [], errors
        db = dbm.connect(db_url)
        assert dbm.current_revision(db) == "0004"
        with db.begin() as conn:
            for table in ("alembic_version", "controls", "gaps", "request_events", "requests"):
                conn.execute(text(f"DROP TABLE {table}"))
            for table in ("steps", "runs", "engines"):
                conn.execute(text(f"DROP TABLE {table}"))
            for table in ("fleet_collectors", "fleet_engines", "fleet_controls"):
                conn.execute(text(f"DROP TABLE {table}"))
        db.dispose()


def test_postgresql_connect_and_statement_timeouts(pg_server: Any) -> None:
    url = pg_server.create_database()
    db = dbm.connect(url, statement_timeout=0.2)
    with db.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "200ms"
        t0 = time.monotonic()
        with pytest.raises(Exception, match="statement timeout"):
            conn.execute(text("SELECT pg_sleep(5)"))
        assert time.monotonic() - t0 < 4
    db.dispose()
    # defaults: 60 s statements; a URL's own option wins
    db = dbm.connect(url)
    with db.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "1min"
    db.dispose()
    # a port nobody listens on: the connect fails within the timeout, not a hang
    import socket

    with socket.socket() as s:  # listens, never answers: libpq waits for the server's reply
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        dead = dbm.connect(f"postgresql+psycopg://u@127.0.0.1:{port}/x", connect_timeout=1)
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - psycopg's OperationalError
            with dead.connect():
                pass
        assert time.monotonic() - t0 < 8
        dead.dispose()


def test_timeouts_are_checked(monkeypatch: Any) -> None:
    monkeypatch.setenv("CHUNKSCOPE_DB_STATEMENT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CHUNKSCOPE_DB_STATEMENT_TIMEOUT"):
        dbm.connect("postgresql+psycopg://u@127.0.0.1:1/x")
