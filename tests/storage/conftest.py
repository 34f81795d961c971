"""Fixtures for the storage tests: a database URL per backend (SQLite file in tmp_path, or a
fresh database on a private PostgreSQL server started once per session), and a collector in a
background thread on port 0."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testkit.collector import collector_in_thread
from testkit.postgres import PostgresServer, PostgresUnavailable

BACKENDS = ["sqlite", "postgresql"]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """A private PostgreSQL server; skipped (or failed, when CHUNKSCOPE_REQUIRE_POSTGRES=1) with
    the reason when none can start here."""
    try:
        server = PostgresServer.start()
    except PostgresUnavailable as exc:
        reason = f"no PostgreSQL server: {exc}"
        if os.environ.get("CHUNKSCOPE_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sqlite_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A fresh, empty database on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    server: PostgresServer = request.getfixturevalue("pg_server")
    return server.create_database()


@pytest.fixture
def collector_factory() -> Iterator[Callable[..., Any]]:
    """``collector_factory(db_url, **CollectorConfig options)`` -> a started in-process
    collector (``.url``); all stopped at teardown."""
    stack: list[Any] = []

    def make(db_url: str, **options: Any) -> Any:
        cm = collector_in_thread(db_url, **options)
        collector = cm.__enter__()
        stack.append(cm)
        return collector

    def stop_last() -> None:
        stack.pop().__exit__(None, None, None)

    make.stop_last = stop_last  # type: ignore[attr-defined]
    yield make
    while stack:
        stack.pop().__exit__(None, None, None)


@pytest.fixture
def collector(collector_factory: Callable[..., Any], db_url: str) -> Any:
    """A collector on each backend's fresh database."""
    return collector_factory(db_url)
