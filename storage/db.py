"""Database connections and migrations.

``connect(url)`` returns a SQLAlchemy ``Engine``; for SQLite every new connection gets WAL mode,
``synchronous=NORMAL`` and a busy timeout through SQLAlchemy's ``connect`` event, so readers (the
dashboard) never block the collector's writer. ``connect(url, readonly=True)`` additionally makes
every connection refuse writes. ``migrate(engine)`` runs the Alembic revisions in
``storage/migrations`` up to head, from code (there is no alembic.ini).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DB_FILENAME = "chunkscope.db"
BUSY_TIMEOUT_MS = 10_000


def default_url(data_dir: str | Path) -> str:
    """The default store: ``sqlite:///<data_dir>/chunkscope.db``."""
    return f"sqlite:///{Path(data_dir) / DB_FILENAME}"


def is_sqlite(db: Engine) -> bool:
    return db.dialect.name == "sqlite"


def connect(url: str, *, readonly: bool = False, echo: bool = False) -> Engine:
    """A SQLAlchemy engine for ``url`` (``sqlite:///path`` or ``postgresql+psycopg://...``).

    The folder of a SQLite file is created when missing. ``readonly`` connections refuse
    writes (SQLite ``query_only``; PostgreSQL read-only transactions) and create nothing: a
    read-only SQLite URL whose file does not exist is a ``FileNotFoundError`` (opening it would
    leave an empty database behind, at a path that may be a typo).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"database URL must be a non-empty string, got {url!r}")
    try:
        parsed = make_url(url)
    except Exception as exc:  # sqlalchemy.exc.ArgumentError
        raise ValueError(
            f"not a database URL: {url!r} (expected e.g. sqlite:///data/chunkscope.db or "
            "postgresql+psycopg://user@host/db)"
        ) from exc
    backend = parsed.get_backend_name()
    kwargs: dict[str, Any] = {"echo": echo}
    if backend == "sqlite":
        path = parsed.database
        if path and path != ":memory:" and not path.startswith("file:"):
            if readonly and not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"no store at {path} (from {url!r})")
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
    elif backend == "postgresql":
        kwargs["pool_pre_ping"] = True
    else:
        raise ValueError(
            f"unsupported database {backend!r}: use sqlite:// or postgresql+psycopg://"
        )
    db = create_engine(url, **kwargs)
    if backend == "sqlite":
        event.listen(db, "connect", _sqlite_pragmas(readonly))
    elif readonly:
        event.listen(db, "connect", _pg_readonly)
    return db


def _sqlite_pragmas(readonly: bool) -> Any:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if not readonly:
                cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA cache_size = -65536")  # 64 MiB page cache per connection
            if readonly:
                cursor.execute("PRAGMA query_only = ON")
        finally:
            cursor.close()

    return on_connect


def _pg_readonly(dbapi_connection: Any, _record: Any) -> None:
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    finally:
        dbapi_connection.autocommit = autocommit


def alembic_config(db: Engine | None = None) -> Any:
    """An Alembic ``Config`` built in code, its scripts in ``storage/migrations``."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if db is not None:
        cfg.set_main_option("sqlalchemy.url", db.url.render_as_string(hide_password=False))
    return cfg


def migrate(db: Engine) -> None:
    """Bring the store to the newest schema (Alembic ``upgrade head``); safe to run again."""
    from alembic import command

    cfg = alembic_config(db)
    with db.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
    logger.info("store at %s migrated to head", db.url.render_as_string(hide_password=True))


def current_revision(db: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
