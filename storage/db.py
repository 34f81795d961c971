"""Database connections and migrations.

``connect(url)`` returns a SQLAlchemy ``Engine``; for SQLite every new connection gets WAL mode,
``synchronous=NORMAL`` and a busy timeout through SQLAlchemy's ``connect`` event, so readers (the
dashboard) never block the collector's writer. ``connect(url, readonly=True)`` additionally makes
every connection refuse writes. ``migrate(engine)`` runs the Alembic revisions in
``storage/migrations`` up to head, from code (there is no alembic.ini).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

logger = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
DB_FILENAME = "chunkscope.db"
BUSY_TIMEOUT_MS = 10_000
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_STATEMENT_TIMEOUT_S = 60.0
# pg_advisory_xact_lock key held around a migration: "chunkscope" in ASCII, folded to 63 bits
MIGRATION_LOCK_KEY = int.from_bytes(b"chunksco", "big") & 0x7FFF_FFFF_FFFF_FFFF


class SchemaTooNew(ValueError):
    """The store is at a schema revision this chunkscope does not know (a newer one wrote it)."""


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {raw!r}")
    return value


# scheme://user:password@ : the password runs to the last "@" (an unescaped "@" in it too)
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]*):(?P<pw>\S*)@")


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***``, whether or not it parses: for messages and
    logs (a URL must never be shown any other way)."""
    return _CREDENTIALS.sub(r"\g<head>:***@", url)


def scrub(text: str, url: str) -> str:
    """``text`` (an error message, say) with every form of ``url``'s password replaced by
    ``***``: as typed in the URL, decoded, and inside the URL itself."""
    secrets = {m.group("pw") for m in _CREDENTIALS.finditer(url)}
    try:
        password = make_url(url).password
    except Exception:  # not a URL: its raw password form is still scrubbed
        password = None
    if password:
        secrets.add(str(password))
    text = text.replace(url, masked_url(url))
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, "***")
    return masked_url(text)


def default_url(data_dir: str | Path) -> str:
    """The default store: ``sqlite:///<data_dir>/chunkscope.db``."""
    return f"sqlite:///{Path(data_dir) / DB_FILENAME}"


def is_sqlite(db: Engine) -> bool:
    return db.dialect.name == "sqlite"


def connect(
    url: str,
    *,
    readonly: bool = False,
    echo: bool = False,
    connect_timeout: float | None = None,
    statement_timeout: float | None = None,
) -> Engine:
    """A SQLAlchemy engine for ``url`` (``sqlite:///path`` or ``postgresql+psycopg://...``).

    The folder of a SQLite file is created when missing. ``readonly`` connections refuse
    writes (SQLite ``query_only``; PostgreSQL read-only transactions) and create nothing: a
    read-only SQLite URL whose file does not exist is a ``FileNotFoundError`` (opening it would
    leave an empty database behind, at a path that may be a typo).

    ``connect_timeout`` / ``statement_timeout`` (seconds; PostgreSQL only; None: from the
    environment, else the defaults above; a statement timeout of 0 is none).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"database URL must be a non-empty string, got {type(url).__name__}")
    try:
        parsed = make_url(url)
        parsed.port  # noqa: B018  (a port that is not a number raises here, not later)
    except Exception:  # sqlalchemy.exc.ArgumentError, ValueError
        raise ValueError(
            f"not a database URL: {masked_url(url)!r} (expected e.g. "
            "sqlite:///data/chunkscope.db or postgresql+psycopg://user:password@host/db, with "
            "characters such as @ : / % in the password escaped as %40 %3A %2F %25)"
        ) from None
    backend = parsed.get_backend_name()
    kwargs: dict[str, Any] = {"echo": echo}
    if backend == "sqlite":
        path = parsed.database
        if path and path != ":memory:" and not path.startswith("file:"):
            if readonly and not Path(path).expanduser().is_file():
                raise FileNotFoundError(f"no store at {path} (from {masked_url(url)!r})")
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000}
    elif backend == "postgresql":
        kwargs["pool_pre_ping"] = True
        if connect_timeout is None:
            connect_timeout = _env_seconds(
                "CHUNKSCOPE_DB_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT_S
            )
        if statement_timeout is None:
            statement_timeout = _env_seconds(
                "CHUNKSCOPE_DB_STATEMENT_TIMEOUT", DEFAULT_STATEMENT_TIMEOUT_S
            )
        if not connect_timeout > 0 or not statement_timeout >= 0:
            raise ValueError(
                f"timeouts must be positive (connect {connect_timeout}, statement "
                f"{statement_timeout})"
            )
        connect_args: dict[str, Any] = {}
        if "connect_timeout" not in parsed.query:
            # libpq takes whole seconds; at least 1 (0 would mean wait forever)
            connect_args["connect_timeout"] = max(1, round(connect_timeout))
        if statement_timeout and "options" not in parsed.query:
            connect_args["options"] = f"-c statement_timeout={round(statement_timeout * 1000)}"
        kwargs["connect_args"] = connect_args
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
        # for display only (the migrations run on the connection in ``cfg.attributes``): no
        # password, and "%" doubled because the config interpolates it
        url = db.url.render_as_string(hide_password=True)
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(db: Engine) -> None:
    """Bring the store to the newest schema (Alembic ``upgrade head``); safe to run again and
    from several processes at once (one migrates, the others wait, then find it done).
    Raises :class:`SchemaTooNew` (changing nothing) when the store is at a revision this code
    does not know."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    cfg = alembic_config(db)
    script = ScriptDirectory.from_config(cfg)
    with _sqlite_file_lock(db), db.begin() as connection:
        if connection.dialect.name == "postgresql":
            # held to the end of this transaction: a second collector waits here, then sees
            # the first one's revision (DDL is transactional in PostgreSQL)
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
        current = MigrationContext.configure(connection).get_current_heads()
        unknown = [rev for rev in current if not _known(script, rev)]
        if unknown:
            raise SchemaTooNew(
                f"the store {db.url.render_as_string(hide_password=True)} is at schema "
                f"revision {', '.join(unknown)}, which this chunkscope does not know (newest "
                f"known: {script.get_current_head()}): it was written by a newer chunkscope. "
                "Upgrade chunkscope, or give another --db / --data-dir"
            )
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")
    logger.info("store at %s migrated to head", db.url.render_as_string(hide_password=True))


def _known(script: Any, rev: str) -> bool:
    try:
        return script.get_revision(rev) is not None
    except Exception:  # alembic.util.CommandError / ResolutionError: not in our scripts
        return False


@contextlib.contextmanager
def _sqlite_file_lock(db: Engine) -> Iterator[None]:
    """An exclusive ``flock`` on ``<database>.migrate.lock`` while a SQLite file is migrated
    (SQLite runs Alembic's DDL outside one transaction, so two migrators would interleave).
    No lock for PostgreSQL (its advisory lock) or in-memory databases."""
    path = db.url.database if is_sqlite(db) else None
    if not path or path == ":memory:" or path.startswith("file:"):
        yield
        return
    import fcntl

    lock_path = Path(path).expanduser()
    lock_path = lock_path.with_name(lock_path.name + ".migrate.lock")
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def current_revision(db: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
