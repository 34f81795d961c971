"""What an export reads: the selection (engine, run, window), the store opened read-only and
the five tables of a selection, read through ``storage.queries`` only. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from storage import queries
from storage.columns import STEP_CHUNKS_COLUMNS, TOKENS_COLUMNS, empty
from storage.db import connect, masked_url, scrub


class ExportError(Exception):
    """A selection that cannot be exported (the message says why); the CLI exits with 2."""


@dataclass(frozen=True)
class Selection:
    engine_id: str | None = None
    run_id: str | None = None
    since: float | None = None
    until: float | None = None

    def describe(self) -> str:
        parts = [
            f"{name}={value}"
            for name, value in (
                ("engine", self.engine_id),
                ("run", self.run_id),
                ("since", self.since),
                ("until", self.until),
            )
            if value is not None
        ]
        return ", ".join(parts) if parts else "everything"


# ---- reading ----------------------------------------------------------------------------------


def open_store(url: str) -> Any:
    """A read-only SQLAlchemy engine on an existing store; ``ExportError`` when ``url`` is not a
    database URL or names a SQLite file that does not exist (nothing is created)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception as exc:  # sqlalchemy.exc.ArgumentError
        raise ExportError(
            f"not a database URL: {masked_url(url)!r} (expected e.g. "
            "sqlite:///data/chunkscope.db or postgresql+psycopg://user@host/db)"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        path = parsed.database
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ExportError(f"not a stored SQLite file: {masked_url(url)!r}")
        if not Path(path).expanduser().is_file():
            raise ExportError(f"no store at {path} (from {masked_url(url)!r})")
    try:
        return connect(url, readonly=True)
    except ValueError as exc:
        raise ExportError(scrub(str(exc), url)) from exc
    except ImportError as exc:  # a PostgreSQL URL without its driver
        raise ExportError(f"cannot open {masked_url(url)!r}: {scrub(str(exc), url)}") from exc


def load_tables(db: Any, selection: Selection) -> dict[str, pd.DataFrame]:
    """The five tables of a selection (see the module docstring), read through
    ``storage.queries``. Raises ``ExportError`` when the store cannot be read."""
    from sqlalchemy.exc import SQLAlchemyError

    filters: dict[str, Any] = {
        "engine_id": selection.engine_id,
        "run_id": selection.run_id,
        "since": selection.since,
        "until": selection.until,
    }
    try:
        steps = queries.steps(db, **filters)
        chunks = _chunks_of(db, steps)
        requests = queries.requests(db, **filters)
        itl = queries.token_itl(db, **filters)
        controls = queries.controls(db, **filters)
    except SQLAlchemyError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        why = scrub(first_line, db.url.render_as_string(hide_password=False))
        raise ExportError(f"cannot read the store: {why}") from exc
    tokens = _tokens(chunks, steps, itl)
    return {
        "steps": steps,
        "chunks": chunks,
        "requests": requests,
        "tokens": tokens,
        "controls": controls,
    }


def _chunks_of(db: Any, steps: pd.DataFrame) -> pd.DataFrame:
    """The chunks of exactly the selected steps (``step_chunks`` reads a step range per run)."""
    frames = []
    for (engine_id, run_id), group in steps.groupby(["engine_id", "run_id"], sort=False):
        chunks = queries.step_chunks(
            db,
            engine_id=engine_id,
            run_id=run_id,
            step_from=int(group["step"].min()),
            step_to=int(group["step"].max()),
        )
        chunks = chunks[chunks["step"].isin(group["step"])]
        frames.append(chunks)
    frames = [f for f in frames if not f.empty]
    if not frames:
        return empty(STEP_CHUNKS_COLUMNS)
    return pd.concat(frames, ignore_index=True)[STEP_CHUNKS_COLUMNS]


def _tokens(chunks: pd.DataFrame, steps: pd.DataFrame, itl: pd.DataFrame) -> pd.DataFrame:
    """Every token the selected steps produced: ``token_itl`` gives tokens k >= 2 (with their
    index and gap); a produced chunk without a match there is a request's first token."""
    keys = ["engine_id", "run_id", "request_id", "step"]
    produced = chunks[chunks["produced_token"].astype(bool)]
    if produced.empty:
        return empty(TOKENS_COLUMNS)
    produced = produced[[*keys, "traffic_class"]].merge(
        steps[["engine_id", "run_id", "step", "end"]], on=["engine_id", "run_id", "step"]
    )
    later = itl[[*keys, "k", "time", "itl_ms"]]
    merged = produced.merge(later, on=keys, how="left")
    first = merged["k"].isna()
    merged["k"] = merged["k"].where(~first, 1).astype(np.int64)
    merged["time"] = merged["time"].where(~first, merged["end"]).astype("float64")
    merged["itl_ms"] = merged["itl_ms"].astype("float64").where(~first)
    merged["step"] = merged["step"].astype(np.int64)
    return merged.sort_values(["time", "engine_id", "run_id", "step"], kind="stable")[
        TOKENS_COLUMNS
    ].reset_index(drop=True)
