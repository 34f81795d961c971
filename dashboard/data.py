"""Cached reads of the store for the pages (which hold no SQL): every function here calls one
``storage.queries`` function through ``st.cache_data`` with a short ``ttl``, on a read-only
connection kept with ``st.cache_resource``.

A store that cannot be read (not created yet, collector never started, a bad URL) raises
:class:`StoreUnavailable` with a reason the page shows; pages keep drawing what they have.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd
import streamlit as st

logger = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The store cannot be read right now (the reason is in the message)."""


def queries() -> Any:
    """``storage.queries`` (imported late: the dashboard still starts, and says why, when the
    storage package cannot be imported)."""
    try:
        from storage import queries as q
    except ImportError as exc:
        raise StoreUnavailable(f"the storage package cannot be imported: {exc}") from exc
    return q


def shown_url(db_url: str | None) -> str:
    """``db_url`` as the dashboard shows it: the password as ``***``."""
    if not db_url:
        return "—"
    try:
        from storage.db import masked_url
    except ImportError:
        return "(a database URL)"
    return masked_url(db_url)


def _scrub(text: str, db_url: str) -> str:
    try:
        from storage.db import scrub
    except ImportError:
        return "(reason hidden: the storage package cannot be imported)"
    return scrub(text, db_url)


@st.cache_resource(show_spinner=False)
def _connect(db_url: str) -> Any:
    from storage import db as storage_db

    return storage_db.connect(db_url, readonly=True)


def connection(db_url: str | None) -> Any:
    if not db_url:
        raise StoreUnavailable("no store configured (give --db URL or CHUNKSCOPE_DB_URL)")
    try:
        return _connect(db_url)
    except ImportError as exc:
        raise StoreUnavailable(f"the storage package cannot be imported: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any driver error means: cannot read the store
        why = _scrub(str(exc), db_url)
        raise StoreUnavailable(f"cannot open the store {shown_url(db_url)}: {why}") from exc


def _call(db_url: str | None, name: str, **kwargs: Any) -> pd.DataFrame:
    db = connection(db_url)
    fn = getattr(queries(), name)
    try:
        return fn(db, **kwargs)
    except StoreUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - e.g. OperationalError: no tables yet, file gone
        raise StoreUnavailable(f"cannot read the store ({name}): {_short(exc)}") from exc


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


@st.cache_data(ttl=30.0, show_spinner=False)
def store_size(db_url: str | None) -> tuple[int, int]:
    """(bytes the retention limits count, bytes on disk): ``storage.retention.store_size``."""
    db = connection(db_url)
    try:
        from storage.retention import store_size as measure

        size = measure(db)
    except Exception as exc:  # noqa: BLE001 - any driver error: not readable now
        raise StoreUnavailable(f"cannot measure the store: {_short(exc)}") from exc
    return size.used_bytes, size.file_bytes


@st.cache_data(ttl=1.0, show_spinner=False)
def engines(db_url: str | None) -> pd.DataFrame:
    return _call(db_url, "engines")


@st.cache_data(ttl=1.0, show_spinner=False)
def controls(
    db_url: str | None,
    engine_id: str | None,
    run_id: str | None,
    since: float | None = None,
    until: float | None = None,
) -> pd.DataFrame:
    return _call(db_url, "controls", engine_id=engine_id, run_id=run_id, since=since, until=until)


@st.cache_data(ttl=5.0, show_spinner=False)
def latency_summary(
    db_url: str | None,
    engine_id: str | None,
    run_id: str | None,
    since: float | None,
    until: float | None,
) -> pd.DataFrame:
    return _call(
        db_url, "latency_summary", engine_id=engine_id, run_id=run_id, since=since, until=until
    )


@st.cache_data(ttl=5.0, show_spinner=False)
def steps(
    db_url: str | None,
    engine_id: str | None,
    run_id: str | None,
    since: float | None = None,
    until: float | None = None,
    limit: int | None = None,
) -> pd.DataFrame:
    return _call(
        db_url, "steps", engine_id=engine_id, run_id=run_id, since=since, until=until, limit=limit
    )


@st.cache_data(ttl=5.0, show_spinner=False)
def step_chunks(
    db_url: str | None, engine_id: str | None, run_id: str | None, step_from: int, step_to: int
) -> pd.DataFrame:
    return _call(
        db_url,
        "step_chunks",
        engine_id=engine_id,
        run_id=run_id,
        step_from=step_from,
        step_to=step_to,
    )


@st.cache_data(ttl=3.0, show_spinner=False)
def requests(
    db_url: str | None,
    engine_id: str | None,
    run_id: str | None,
    since: float | None = None,
    until: float | None = None,
    traffic_class: str | None = None,
) -> pd.DataFrame:
    return _call(
        db_url,
        "requests",
        engine_id=engine_id,
        run_id=run_id,
        since=since,
        until=until,
        traffic_class=traffic_class,
    )


@st.cache_data(ttl=5.0, show_spinner=False)
def token_times(
    db_url: str | None, engine_id: str | None, run_id: str | None, request_id: str
) -> pd.DataFrame:
    return _call(db_url, "token_times", engine_id=engine_id, run_id=run_id, request_id=request_id)


@st.cache_data(ttl=5.0, show_spinner=False)
def gaps(db_url: str | None, engine_id: str | None, run_id: str | None) -> pd.DataFrame:
    return _call(db_url, "gaps", engine_id=engine_id, run_id=run_id)


@st.cache_data(ttl=5.0, show_spinner=False)
def stall_window(
    db_url: str | None,
    engine_id: str,
    run_id: str,
    since: float,
    until: float,
    traffic_class: str | None = "chat",
) -> Any:
    """``storage.stalls.stall_window``: the stalls of one run's streams over a window."""
    db = connection(db_url)
    try:
        from storage.stalls import stall_window as read

        return read(
            db,
            engine_id=engine_id,
            run_id=run_id,
            since=since,
            until=until,
            traffic_class=traffic_class,
        )
    except Exception as exc:  # noqa: BLE001 - any driver error: not readable now
        raise StoreUnavailable(f"cannot read the store (stalls): {_short(exc)}") from exc


@st.cache_data(ttl=5.0, show_spinner=False)
def fleet(db_url: str | None) -> pd.DataFrame:
    """``storage.fleet_summary.fleet_summary``: every engine, worst first."""
    db = connection(db_url)
    try:
        from storage.fleet_summary import fleet_summary

        return fleet_summary(db)
    except Exception as exc:  # noqa: BLE001 - any driver error: not readable now
        raise StoreUnavailable(f"cannot read the store (fleet): {_short(exc)}") from exc
