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
- ``tokens``: one row per output token produced by those steps (``TOKENS_COLUMNS``): its index
  ``k`` (1 = first token), wall time, step and the gap to the previous token (``itl_ms``, empty
  for ``k = 1``),
- ``controls``: budget and policy changes (``queries.CONTROLS_COLUMNS``; the old and new values
  as JSON text).

Times are wall-clock seconds since the epoch (floats), ``*_ns`` the engine's monotonic clock,
durations milliseconds, as in ``storage.queries``.

**Chrome trace**: ``PATH`` is a file (``.json``, or ``.json.gz`` to compress) in the trace-event
"JSON Object Format" (``{"traceEvents": [...], "displayTimeUnit": "ms"}``) that ui.perfetto.dev
and chrome://tracing open. Timestamps (``ts``) and durations (``dur``) are **microseconds
relative to the earliest time in the selection** (a step start or a request arrival); that
origin, in seconds since the epoch, is ``otherData.time_origin_unix_s``. Every time comes from
the store's wall-clock columns through one monotone mapping, so slices that follow each other in
the engine never overlap in the trace. One process per run (``engine <id> / run <id>``) holds:

- thread ``steps``: each step a complete slice (``"ph": "X"``) named ``step prefill``,
  ``step decode`` or ``step prefill+decode``, its numbers and its chunk layout (request id,
  kind, start, num_tokens, produced) in ``args``; budget and policy changes as instant events
  (``"ph": "i"``);
- one thread per request (``req <id> [class]``, sorted by arrival): a slice from arrival to
  finish (or to the last time the selection knows of), nested phase slices ``queued``
  (arrival -> first scheduled), ``prefill`` (-> first token) and ``decode`` (-> finish), the
  request's chunks as slices of the steps that carried them (``prefill 512``, ``decode 1``;
  one that produced a token has its index ``args.token`` and, from the second token on, the
  gap to the previous one ``args.itl_ms``) and an instant ``first token``;
- counters (``"ph": "C"``, sampled at each step start): ``tokens`` (budget), ``tokens scheduled``
  (prefill, decode), ``KV blocks`` (used) and ``requests`` (running, waiting);
- names and order through metadata events (``"ph": "M"``).

Thread ids are unique in the whole trace and each run's ``pid`` is the tid of its steps thread
(Perfetto keys threads by tid alone).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from storage import queries
from storage.db import connect, default_url

logger = logging.getLogger(__name__)

FORMATS = ("chrome-trace", "csv", "parquet")
TABLES = ("steps", "chunks", "requests", "tokens", "controls")
TOKENS_COLUMNS = [
    "engine_id",
    "run_id",
    "request_id",
    "traffic_class",
    "k",
    "time",
    "step",
    "itl_ms",
]


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
            f"not a database URL: {url!r} (expected e.g. sqlite:///data/chunkscope.db or "
            "postgresql+psycopg://user@host/db)"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        path = parsed.database
        if not path or path == ":memory:" or path.startswith("file:"):
            raise ExportError(f"not a stored SQLite file: {url!r}")
        if not Path(path).expanduser().is_file():
            raise ExportError(f"no store at {path} (from {url!r})")
    try:
        return connect(url, readonly=True)
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    except ImportError as exc:  # a PostgreSQL URL without its driver
        raise ExportError(f"cannot open {url!r}: {exc}") from exc


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
        raise ExportError(f"cannot read the store: {first_line}") from exc
    tokens = _tokens(chunks, steps, itl)
    return {
        "steps": steps,
        "chunks": chunks,
        "requests": requests,
        "tokens": tokens,
        "controls": controls,
    }


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})


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
        return _empty(queries.STEP_CHUNKS_COLUMNS)
    return pd.concat(frames, ignore_index=True)[queries.STEP_CHUNKS_COLUMNS]


def _tokens(chunks: pd.DataFrame, steps: pd.DataFrame, itl: pd.DataFrame) -> pd.DataFrame:
    """Every token the selected steps produced: ``token_itl`` gives tokens k >= 2 (with their
    index and gap); a produced chunk without a match there is a request's first token."""
    keys = ["engine_id", "run_id", "request_id", "step"]
    produced = chunks[chunks["produced_token"].astype(bool)]
    if produced.empty:
        return _empty(TOKENS_COLUMNS)
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


# ---- CSV and Parquet --------------------------------------------------------------------------


def _portable(df: pd.DataFrame) -> pd.DataFrame:
    """Columns a CSV or Parquet file holds as one type: mixed values (control values) as JSON."""
    out = df.copy()
    for name in ("old_value", "new_value"):
        if name in out.columns:
            out[name] = pd.Series(
                [None if v is None else json.dumps(v) for v in out[name]],
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


# ---- Chrome trace -----------------------------------------------------------------------------


def _num(value: Any) -> Any:
    """A JSON-safe scalar: numpy numbers as Python ones, NaN / NaT as None."""
    if value is None:
        return None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        f = float(value)
        return None if math.isnan(f) else f
    if isinstance(value, (np.bool_,)):
        return bool(value)
    try:
        if pd.isna(value):
            return None
    except (TypeError, ValueError):
        pass
    return value


def _finite(value: Any) -> float | None:
    v = _num(value)
    return None if v is None else float(v)


def _step_name(prefill: int, decode: int) -> str:
    if prefill and decode:
        return "step prefill+decode"
    return "step prefill" if prefill else "step decode"


class _Trace:
    def __init__(self, origin: float) -> None:
        self.origin = origin
        self.events: list[dict[str, Any]] = []
        self._last_tid = 0

    def new_tid(self) -> int:
        """A thread id unique in the whole trace (Perfetto keys threads by tid alone)."""
        self._last_tid += 1
        return self._last_tid

    def us(self, t: float) -> float:
        """Microseconds since the origin (monotone in ``t``)."""
        return (t - self.origin) * 1e6

    def meta(self, name: str, pid: int, tid: int, args: dict[str, Any]) -> None:
        self.events.append({"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args})

    def slice(
        self, name: str, pid: int, tid: int, t0: float, t1: float, args: dict[str, Any] | None
    ) -> None:
        ts, te = self.us(t0), self.us(t1)
        ev: dict[str, Any] = {
            "name": name,
            "cat": "chunkscope",
            "ph": "X",
            "ts": ts,
            "dur": max(0.0, te - ts),
            "pid": pid,
            "tid": tid,
        }
        if args:
            ev["args"] = args
        self.events.append(ev)

    def instant(
        self, name: str, pid: int, tid: int, t: float, args: dict[str, Any], scope: str = "t"
    ) -> None:
        self.events.append(
            {
                "name": name,
                "cat": "chunkscope",
                "ph": "i",
                "s": scope,
                "ts": self.us(t),
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )

    def counter(self, name: str, pid: int, t: float, values: dict[str, Any]) -> None:
        """A process counter sample (written on the process's main thread, tid = pid)."""
        args = {k: _num(v) for k, v in values.items()}
        args = {k: v for k, v in args.items() if v is not None}
        if args:
            self.events.append(
                {"name": name, "ph": "C", "ts": self.us(t), "pid": pid, "tid": pid, "args": args}
            )


def _runs(tables: dict[str, pd.DataFrame]) -> list[tuple[str, str]]:
    """(engine_id, run_id) of every run in the selection, by its first time."""
    first: dict[tuple[str, str], float] = {}
    for name, col in (("steps", "start"), ("requests", "arrival"), ("controls", "time")):
        df = tables[name]
        if df.empty:
            continue
        for key, value in df.groupby(["engine_id", "run_id"], sort=False)[col].min().items():
            v = _finite(value)
            k = (str(key[0]), str(key[1]))
            if v is not None and (k not in first or v < first[k]):
                first[k] = v
            first.setdefault(k, math.inf)
    return sorted(first, key=lambda k: (first[k], k))


def _origin(tables: dict[str, pd.DataFrame]) -> float:
    candidates = []
    for name, cols in (
        ("steps", ("start",)),
        ("requests", ("arrival", "first_scheduled", "first_token", "finished")),
        ("controls", ("time",)),
    ):
        df = tables[name]
        for col in cols:
            if not df.empty:
                v = _finite(pd.to_numeric(df[col], errors="coerce").min())
                if v is not None:
                    candidates.append(v)
    return min(candidates) if candidates else 0.0


def _of_run(df: pd.DataFrame, engine_id: str, run_id: str) -> pd.DataFrame:
    if df.empty:
        return df
    return df[(df["engine_id"] == engine_id) & (df["run_id"] == run_id)]


def chrome_trace(tables: dict[str, pd.DataFrame]) -> dict[str, Any]:
    """The selection as a trace-event JSON object (see the module docstring)."""
    origin = _origin(tables)
    trace = _Trace(origin)
    for engine_id, run_id in _runs(tables):
        _run_events(
            trace,
            engine_id,
            run_id,
            _of_run(tables["steps"], engine_id, run_id),
            _of_run(tables["chunks"], engine_id, run_id),
            _of_run(tables["requests"], engine_id, run_id),
            _of_run(tables["tokens"], engine_id, run_id),
            _of_run(tables["controls"], engine_id, run_id),
        )
    # traceEvents last: Perfetto reads displayTimeUnit only before the events
    return {
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "chunkscope export",
            "time_origin_unix_s": origin,
            "time_unit": "microseconds since time_origin_unix_s",
        },
        "traceEvents": trace.events,
    }


def _records(df: pd.DataFrame) -> Iterator[dict[str, Any]]:
    """Rows as dicts (columns turned into Python lists once: iterating Arrow-backed strings
    value by value is slow)."""
    cols = list(df.columns)
    values = [df[c].tolist() for c in cols]
    for row in zip(*values, strict=True):
        yield dict(zip(cols, row, strict=True))


def _run_events(
    trace: _Trace,
    engine_id: str,
    run_id: str,
    steps: pd.DataFrame,
    chunks: pd.DataFrame,
    requests: pd.DataFrame,
    tokens: pd.DataFrame,
    controls: pd.DataFrame,
) -> None:
    # the steps thread is the run's main thread: pid = its tid
    pid = steps_tid = trace.new_tid()
    trace.meta("process_name", pid, pid, {"name": f"engine {engine_id} / run {run_id}"})
    trace.meta("process_sort_index", pid, pid, {"sort_index": pid})
    trace.meta("thread_name", pid, steps_tid, {"name": "steps"})
    trace.meta("thread_sort_index", pid, steps_tid, {"sort_index": 0})

    step_times: dict[int, tuple[float, float]] = {}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for c in _records(chunks):
        by_step.setdefault(int(c["step"]), []).append(c)
    for s in _records(steps):
        step = int(s["step"])
        start, end = float(s["start"]), float(s["end"])
        step_times[step] = (start, end)
        layout = [
            {
                "request_id": c["request_id"],
                "kind": c["kind"],
                "start": int(c["start"]),
                "num_tokens": int(c["num_tokens"]),
                "produced": bool(c["produced_token"]),
            }
            for c in by_step.get(step, [])
        ]
        prefill, decode = int(s["num_prefill_tokens"]), int(s["num_decode_tokens"])
        trace.slice(
            _step_name(prefill, decode),
            pid,
            steps_tid,
            start,
            end,
            {
                "step": step,
                "token_budget": _num(s["token_budget"]),
                "policy": s["policy"],
                "num_prefill_tokens": prefill,
                "num_decode_tokens": decode,
                "num_scheduled_tokens": _num(s["num_scheduled_tokens"]),
                "num_running": _num(s["num_running"]),
                "num_waiting": _num(s["num_waiting"]),
                "kv_blocks_used": _num(s["kv_blocks_used"]),
                "kv_blocks_total": _num(s["kv_blocks_total"]),
                "num_preemptions": _num(s["num_preemptions"]),
                "duration_ms": _num(s["duration_ms"]),
                "forward_ms": _num(s["forward_ms"]),
                "chunks": layout,
            },
        )
        trace.counter("tokens", pid, start, {"budget": s["token_budget"]})
        trace.counter("tokens scheduled", pid, start, {"prefill": prefill, "decode": decode})
        trace.counter("KV blocks", pid, start, {"used": s["kv_blocks_used"]})
        trace.counter(
            "requests", pid, start, {"running": s["num_running"], "waiting": s["num_waiting"]}
        )

    for c in _records(controls):
        t = _finite(c["time"])
        if t is None:
            continue
        verdict = "" if c["accepted"] else " (refused)"
        trace.instant(
            f"{c['key']} {c['old_value']} -> {c['new_value']}{verdict}",
            pid,
            steps_tid,
            t,
            {k: _num(v) for k, v in c.items() if k not in ("engine_id", "run_id")},
            scope="p",
        )

    # one thread per request, in arrival order (requests known only from chunks last)
    tids: dict[str, int] = {}
    info: dict[str, dict[str, Any]] = {}
    for r in _records(requests):
        rid = str(r["request_id"])
        if rid not in tids:
            tids[rid] = trace.new_tid()
            info[rid] = r
    for rid in chunks["request_id"].dropna().astype(str).unique() if not chunks.empty else []:
        if rid not in tids:
            tids[rid] = trace.new_tid()
    req_chunks: dict[str, list[dict[str, Any]]] = {}
    for c in _records(chunks):
        if c["request_id"] is not None:
            req_chunks.setdefault(str(c["request_id"]), []).append(c)
    # (request id, step) -> (k, itl_ms) of the token that step produced for it
    token_of: dict[tuple[str, int], tuple[int, Any]] = {}
    firsts: dict[str, list[dict[str, Any]]] = {}
    for tok in _records(tokens):
        if tok["request_id"] is None:
            continue
        rid = str(tok["request_id"])
        token_of[(rid, int(tok["step"]))] = (int(tok["k"]), _num(tok["itl_ms"]))
        if int(tok["k"]) == 1:
            firsts.setdefault(rid, []).append(tok)

    for rid, tid in tids.items():
        r = info.get(rid)
        cls = r["traffic_class"] if r is not None else None
        label = f"req {rid}" + (f" [{cls}]" if cls else "")
        trace.meta("thread_name", pid, tid, {"name": label})
        trace.meta("thread_sort_index", pid, tid, {"sort_index": tid})
        spans = [step_times[int(c["step"])] for c in req_chunks.get(rid, [])]
        _request_events(trace, pid, tid, rid, r, req_chunks.get(rid, []), spans, token_of)
        for tok in firsts.get(rid, []):
            t = _finite(tok["time"])
            if t is not None:
                args = {"request_id": rid, "k": 1, "step": _num(tok["step"])}
                trace.instant("first token", pid, tid, t, args)


def _request_events(
    trace: _Trace,
    pid: int,
    tid: int,
    rid: str,
    r: dict[str, Any] | None,
    chunks: list[dict[str, Any]],
    spans: list[tuple[float, float]],
    token_of: dict[tuple[str, int], tuple[int, Any]],
) -> None:
    """The request's slice, its phases and its chunks, properly nested on its thread."""
    known = [t for span in spans for t in span]
    arrival = first_scheduled = first_token = finished = None
    if r is not None:
        arrival = _finite(r["arrival"])
        first_scheduled = _finite(r["first_scheduled"])
        first_token = _finite(r["first_token"])
        finished = _finite(r["finished"])
        known += [t for t in (arrival, first_scheduled, first_token, finished) if t is not None]
    if not known:
        return
    lo, hi = min(known), max(known)
    begin = arrival if arrival is not None else lo
    end = finished if finished is not None else hi
    begin, end = min(begin, lo), max(end, hi)
    if r is not None:
        args = {
            k: _num(r[k])
            for k in (
                "traffic_class",
                "num_prompt_tokens",
                "num_image_tokens",
                "num_cached_tokens",
                "num_output_tokens",
                "finish_reason",
                "ttft_ms",
                "tpot_ms",
                "max_itl_ms",
                "e2e_ms",
            )
        }
        args["request_id"] = rid
        args["finished"] = finished is not None
        trace.slice(f"request {rid}", pid, tid, begin, end, args)
        parents = _phases(begin, end, first_scheduled, first_token)
        for name, t0, t1 in parents:
            trace.slice(name, pid, tid, t0, t1, None)
    else:
        trace.slice(f"request {rid}", pid, tid, begin, end, {"request_id": rid})
        parents: list[tuple[str, float, float]] = []
    for c, (t0, t1) in zip(chunks, spans, strict=True):
        # a chunk runs within one phase; clamp to it so the trace stays properly nested
        for _, p0, p1 in parents:
            if p0 <= t0 < p1 or p0 == p1 == t0:
                t0, t1 = max(t0, p0), min(t1, p1)
                break
        t0, t1 = max(t0, begin), min(t1, end)
        if t1 < t0:
            continue
        step = int(c["step"])
        args = {
            "step": step,
            "kind": c["kind"],
            "start": int(c["start"]),
            "num_tokens": int(c["num_tokens"]),
            "produced": bool(c["produced_token"]),
        }
        token = token_of.get((rid, step)) if c["produced_token"] else None
        if token is not None:
            args["token"] = token[0]
            if token[0] > 1:
                args["itl_ms"] = token[1]
        trace.slice(f"{c['kind']} {int(c['num_tokens'])}", pid, tid, t0, t1, args)


def _phases(
    begin: float, end: float, first_scheduled: float | None, first_token: float | None
) -> list[tuple[str, float, float]]:
    """Contiguous phase slices covering [begin, end]: queued until first scheduled, prefill
    until the first token, decode until the end (a phase not reached runs to the end)."""
    marks: list[tuple[str, float]] = [("queued", begin)]
    if first_scheduled is not None:
        marks.append(("prefill", min(max(first_scheduled, begin), end)))
    if first_token is not None:
        marks.append(("decode", min(max(first_token, marks[-1][1]), end)))
    out = []
    for i, (name, t0) in enumerate(marks):
        t1 = marks[i + 1][1] if i + 1 < len(marks) else end
        if t1 > t0 or (t1 == t0 and name == "queued" and len(marks) == 1):
            out.append((name, t0, t1))
    return out


def write_chrome_trace(tables: dict[str, pd.DataFrame], out: Path) -> Path:
    """The trace as JSON (gzip when ``out`` ends in ``.gz``), written atomically."""
    if out.exists() and out.is_dir():
        raise ExportError(f"--out {out} is a folder; for --format chrome-trace it names a file")
    doc = chrome_trace(tables)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            if out.name.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
                    gz.write(data)
            else:
                raw.write(data)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


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


def export(url: str, selection: Selection, fmt: str, out: str | Path) -> ExportResult:
    """Export the selection of the store at ``url`` as ``fmt`` to ``out``. Raises
    ``ExportError`` (nothing written) for an unknown format, a bad URL or an empty selection."""
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
    try:
        tables = load_tables(db, selection)
    finally:
        db.dispose()
    counts = {name: len(df) for name, df in tables.items()}
    if counts["steps"] == 0 and not _requests_in_window(tables["requests"], selection):
        raise ExportError(f"nothing to export: no steps and no requests for {selection.describe()}")
    if fmt == "chrome-trace":
        paths = [write_chrome_trace(tables, out)]
    else:
        paths = write_tables(tables, out, fmt)
    logger.info("exported %s as %s to %s: %s", selection.describe(), fmt, out, counts)
    return ExportResult(paths=paths, counts=counts)


# ---- command line -----------------------------------------------------------------------------


def parse_time(text: str) -> float:
    """Seconds since the epoch, or an ISO-8601 date/time (without a zone: local time)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (seconds since the epoch or ISO-8601, e.g. 2026-12-01T08:50)"
        ) from None


def build_parser(prog: str = "chunkscope export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Export stored telemetry: a Chrome trace (JSON trace-event format; open it "
        "in ui.perfetto.dev) or steps, chunks, requests, tokens and controls as CSV or Parquet "
        "files. Exit status 2 (nothing written) for a bad URL or an empty selection.",
    )
    p.add_argument(
        "--db",
        default=None,
        help="the store's database URL, e.g. sqlite:///data/chunkscope.db or "
        "postgresql+psycopg://user@host/db (default: sqlite:///<data-dir>/chunkscope.db)",
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


def main(argv: list[str] | None = None, prog: str = "chunkscope export") -> int:
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    selection = Selection(args.engine, args.run, args.since, args.until)
    try:
        result = export(args.db or default_url(args.data_dir), selection, args.format, args.out)
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
