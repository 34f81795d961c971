"""The blame ledger's reads for the pages (``advisor.blame_store``), cached like
``dashboard.data``'s: a store that cannot be read, or a window the ledger cannot blame, raises
``data.StoreUnavailable`` or ``BlameUnavailable`` with the reason the page shows."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import data

# the Requests page blames at most this much of its window (the newest part of it)
MAX_WINDOW_S = 600.0


class BlameUnavailable(RuntimeError):
    """The ledger cannot be computed for this selection (the reason is in the message)."""


def _run(fn: Any, **kwargs: Any) -> Any:
    from advisor.blame import BlameError

    try:
        return fn(**kwargs)
    except BlameError as exc:
        raise BlameUnavailable(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - any driver error: not readable now
        raise data.StoreUnavailable(f"cannot read the store (blame): {exc}") from exc


@st.cache_data(ttl=10.0, show_spinner=False)
def request_blame(
    db_url: str | None, engine_id: str, run_id: str, request_id: str
) -> tuple[dict[str, Any], pd.DataFrame]:
    """What slowed one request (``Ledger.request``) and its gaps (``Ledger.gaps``)."""
    from advisor.blame_store import blame_request

    db = data.connection(db_url)

    def go() -> tuple[dict[str, Any], pd.DataFrame]:
        out, blamed = blame_request(db, engine_id=engine_id, request_id=request_id, run_id=run_id)
        return out, blamed.ledger.gaps(out.get("stored_request_id", request_id))

    result: tuple[dict[str, Any], pd.DataFrame] = _run(go)
    return result


@st.cache_data(ttl=10.0, show_spinner=False)
def window_blame(
    db_url: str | None,
    engine_id: str,
    run_id: str,
    since: float | None,
    until: float | None,
    top: int = 10,
) -> tuple[list[dict[str, Any]], pd.DataFrame, float]:
    """(the ``top`` offenders, the excess caused per class, the window's excess in ms)."""
    from advisor.blame_store import blame_window

    db = data.connection(db_url)

    def go() -> tuple[list[dict[str, Any]], pd.DataFrame, float]:
        ledger = blame_window(
            db, engine_id=engine_id, run_id=run_id, since=since, until=until
        ).ledger
        return ledger.offenders(top), ledger.by_class(), ledger.totals()["excess_ms"]

    result: tuple[list[dict[str, Any]], pd.DataFrame, float] = _run(go)
    return result


@st.cache_data(ttl=60.0, show_spinner=False)
def replay_without(
    db_url: str | None, engine_id: str, run_id: str, request_id: str, culprit: str
) -> tuple[float | None, float | None]:
    """The request's window replayed through the simulator with and without ``culprit``:
    (the request's predicted gain in ms, the ledger's blame on the culprit), None where the
    replay has no figure for it."""
    from advisor.blame_counterfactual import counterfactual
    from advisor.blame_store import blame_request

    db = data.connection(db_url)

    def go() -> tuple[float | None, float | None]:
        out, blamed = blame_request(db, engine_id=engine_id, request_id=request_id, run_id=run_id)
        cf = counterfactual(db, blamed.ledger, [culprit], gap_s=blamed.fit.step_gap_s)
        rid = out.get("stored_request_id", request_id)
        return cf.gain_by_victim.get(rid), cf.blamed_by_victim.get(rid)

    result: tuple[float | None, float | None] = _run(go)
    return result


# the Live page's model is refitted at most this often (seconds of the run's time), on the
# steps of the last LIVE_FIT_S of the run (a minute of a busy engine is plenty to fit on)
LIVE_FIT_S = 60.0


@st.cache_data(ttl=2 * LIVE_FIT_S, show_spinner=False)
def _live_model(db_url: str | None, engine_id: str, run_id: str, bucket: int) -> Any:
    """The step-cost model of the run's minute up to the end of ``bucket`` (a multiple of
    ``LIVE_FIT_S``): one fit per minute of the run, shared by every redraw."""
    from advisor.blame_store import fit_recent

    db = data.connection(db_url)
    until = (bucket + 1) * LIVE_FIT_S
    return _run(
        fit_recent, db=db, engine_id=engine_id, run_id=run_id, until=until, span_s=2 * LIVE_FIT_S
    ).model


def live_stall_blame(
    db_url: str | None, engine_id: str, run_id: str, tokens: pd.DataFrame
) -> pd.DataFrame:
    """``advisor.blame_store.blame_tokens`` for the Live page's stalls (not cached here: the
    page keeps what it blamed). ``BlameUnavailable`` while the model cannot be fitted (too
    few steps yet), ``data.StoreUnavailable`` when the store cannot be read."""
    from advisor.blame_store import blame_tokens

    latest = float(tokens["time"].max())
    model = _live_model(db_url, engine_id, run_id, int(latest // LIVE_FIT_S))
    db = data.connection(db_url)
    out: pd.DataFrame = _run(
        blame_tokens, db=db, engine_id=engine_id, run_id=run_id, tokens=tokens, model=model
    )
    return out
