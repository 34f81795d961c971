"""``chunkscope export``: a stored selection as a Chrome trace (Perfetto), CSV or Parquet. No torch.

chunkscope export --db URL [--engine ID] [--run ID] [--since T] [--until T]
                  --format chrome-trace|csv|parquet --out PATH

The selection is read through ``storage.queries`` only (the same reads as the dashboard):
steps whose start is in [since, until], their chunks, the requests whose lifetime overlaps the
window, the token times of those steps and the controls of the window.

**CSV / Parquet**: ``PATH`` is a folder (created when missing); one file per table:

- ``steps``: one row per step (``queries.STEPS_COLUMNS``),
- ``chunks``: one row per chunk of those steps (``queries.STEP_CHUNKS_COLUMNS``),
- ``requests``: one row per request (``queries.REQUESTS_COLUMNS``),
- ``tokens``: one row per output token produced by those steps
  (``storage.columns.TOKENS_COLUMNS``): its index ``k`` (1 = first token), wall time, step and
  the gap to the previous token (``itl_ms``, empty for ``k = 1``),
- ``controls``: budget and policy changes (``queries.CONTROLS_COLUMNS``; the old and new values
  as JSON text).

Times are wall-clock seconds since the epoch (floats), ``*_ns`` the engine's monotonic clock,
durations milliseconds, as in ``storage.queries``.

**Chrome trace**: ``PATH`` is a file (``.json`` or ``.json.gz``); the format is described in
``storage/chrome_trace.py``.

The selection is read by ``storage/export_read.py``, the trace built by ``storage/chrome_trace.py``;
this module writes the tables and holds the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pandas as pd

from storage.chrome_trace import chrome_trace, write_chrome_trace
from storage.columns import TOKENS_COLUMNS
from storage.db import default_url
from storage.export_read import ExportError, Selection, load_tables, open_store
from wire import credentials

logger = logging.getLogger(__name__)

FORMATS = ("chrome-trace", "csv", "parquet")
TABLES = ("steps", "chunks", "requests", "tokens", "controls")


# ---- CSV and Parquet --------------------------------------------------------------------------


def _portable(df: pd.DataFrame) -> pd.DataFrame:
    """Columns a CSV or Parquet file holds as one type: mixed values (control values) as JSON."""
    out = df.copy()
    for name in ("old_value", "new_value"):
        if name in out.columns:
            out[name] = pd.Series(
                [None if v is None else json.dumps(v, allow_nan=False) for v in out[name]],
                index=out.index,
                dtype=object,
            )
    return out


def write_tables(tables: dict[str, pd.DataFrame], out: Path, fmt: str) -> list[Path]:
    """One file per table under the folder ``out`` (created when missing); the files are
    written to a temporary folder first and moved in place at the end."""
    if fmt not in ("csv", "parquet"):
        raise ExportError(f"unknown table format {fmt!r}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; for --format {fmt} it names a folder")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as tmp:
        for name in TABLES:
            df = _portable(tables[name])
            path = Path(tmp) / f"{name}.{fmt}"
            if fmt == "csv":
                df.to_csv(path, index=False)
            else:
                df.to_parquet(path, index=False, engine="pyarrow")
            paths.append(path)
        final = []
        for path in paths:
            target = out / path.name
            os.replace(path, target)
            final.append(target)
    return final


# ---- the whole export -------------------------------------------------------------------------


@dataclass
class ExportResult:
    paths: list[Path]
    counts: dict[str, int]


def _requests_in_window(requests: pd.DataFrame, selection: Selection) -> bool:
    """Whether a request arrived, was scheduled, got its first token or finished in the window
    (``queries.requests`` also returns requests never finished, whatever the window)."""
    if requests.empty:
        return False
    lo = -math.inf if selection.since is None else selection.since
    hi = math.inf if selection.until is None else selection.until
    for col in ("arrival", "first_scheduled", "first_token", "finished"):
        t = pd.to_numeric(requests[col], errors="coerce")
        if ((t >= lo) & (t <= hi)).any():
            return True
    return False


# what draws the Chrome trace's blame arrows: (store, tables) -> links (see chrome_trace)
LinksFn = Callable[[Any, dict[str, pd.DataFrame]], pd.DataFrame]


def export(
    url: str, selection: Selection, fmt: str, out: str | Path, *, links: LinksFn | None = None
) -> ExportResult:
    """Export the selection of the store at ``url`` as ``fmt`` to ``out``. Raises
    ``ExportError`` (nothing written) for an unknown format, a bad URL or an empty selection.
    ``links``: for a Chrome trace, what gives its blame arrows (none without it)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    if selection.since is not None and selection.until is not None:
        if selection.since > selection.until:
            raise ExportError(f"--since {selection.since} is after --until {selection.until}")
    out = Path(out)
    if fmt == "chrome-trace" and out.is_dir():
        raise ExportError(f"--out {out} is a folder; for --format chrome-trace it names a file")
    if fmt != "chrome-trace" and out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; for --format {fmt} it names a folder")
    db = open_store(url)
    arrows = None
    try:
        tables = load_tables(db, selection)
        if links is not None and fmt == "chrome-trace" and not tables["steps"].empty:
            arrows = links(db, tables)
    finally:
        db.dispose()
    counts = {name: len(df) for name, df in tables.items()}
    if counts["steps"] == 0 and not _requests_in_window(tables["requests"], selection):
        raise ExportError(f"nothing to export: no steps and no requests for {selection.describe()}")
    if fmt == "chrome-trace":
        paths = [write_chrome_trace(tables, out, arrows)]
    else:
        paths = write_tables(tables, out, fmt)
    logger.info("exported %s as %s to %s: %s", selection.describe(), fmt, out, counts)
    return ExportResult(paths=paths, counts=counts)


# ---- command line -----------------------------------------------------------------------------


# The stored times are compared in nanoseconds as 64-bit integers: a bound past 2262 (or before
# 1970) is not a time any store holds, and would overflow the driver instead of selecting nothing.
LATEST_TIME_S = (2**63 - 1) // 1_000_000_000


def parse_time(text: str) -> float:
    """Seconds since the epoch, or an ISO-8601 date/time (without a zone: local time), from 1970
    to 2262 (what a 64-bit nanosecond clock holds)."""
    try:
        value = float(text)
    except ValueError:
        try:
            value = datetime.fromisoformat(text).timestamp()
        except (ValueError, OverflowError, OSError):
            raise argparse.ArgumentTypeError(
                f"not a time: {text!r} (seconds since the epoch or ISO-8601, e.g. 2026-12-01T08:50)"
            ) from None
    if not 0 <= value <= LATEST_TIME_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (seconds since the epoch from 0 to {LATEST_TIME_S}, "
            "i.e. 1970 to 2262)"
        )
    return value


def build_parser(prog: str = "chunkscope export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Export stored telemetry: a Chrome trace (JSON trace-event format; open it "
        "in ui.perfetto.dev) or steps, chunks, requests, tokens and controls as CSV or Parquet "
        "files. Exit status 2 (nothing written) for a bad URL or an empty selection.",
    )
    p.add_argument(
        "--db",
        default=credentials.from_env(credentials.DB_URL_ENV),
        help="the store's database URL, e.g. sqlite:///data/chunkscope.db or "
        f"postgresql+psycopg://user@host/db (default: ${credentials.DB_URL_ENV}, else "
        "sqlite:///<data-dir>/chunkscope.db)",
    )
    p.add_argument(
        "--data-dir", default="./data", help="folder of the default SQLite store (default ./data)"
    )
    p.add_argument("--engine", default=None, help="only this engine id (default: all)")
    p.add_argument("--run", default=None, help="only this run id (default: all)")
    p.add_argument(
        "--since",
        type=parse_time,
        default=None,
        help="from this time: seconds since the epoch or ISO-8601 (local time without a zone)",
    )
    p.add_argument("--until", type=parse_time, default=None, help="up to this time (inclusive)")
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    p.add_argument(
        "--out",
        required=True,
        help="chrome-trace: the file to write (.json or .json.gz); csv / parquet: the folder "
        "that gets steps, chunks, requests, tokens and controls files",
    )
    p.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return p


def main(
    argv: list[str] | None = None, prog: str = "chunkscope export", links: LinksFn | None = None
) -> int:
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    selection = Selection(args.engine, args.run, args.since, args.until)
    try:
        result = export(
            args.db or default_url(args.data_dir), selection, args.format, args.out, links=links
        )
    except ExportError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    summary = ", ".join(f"{n} {name}" for name, n in result.counts.items())
    for path in result.paths:
        print(path)
    print(f"exported {summary}", file=sys.stderr)
    return 0


__all__ = [
    "FORMATS",
    "TABLES",
    "TOKENS_COLUMNS",
    "ExportError",
    "ExportResult",
    "Selection",
    "chrome_trace",
    "export",
    "load_tables",
    "main",
    "open_store",
]
