"""The Chrome trace (Perfetto) of an export selection. No torch.

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
- blame arrows, when the caller passes the ledger's stall links (``chunkscope export`` does):
  a flow (``"ph": "s"`` on the culprit's chunk, ``"ph": "f"`` on the victim's chunk that
  produced the token the stall delayed, category ``blame``, the blamed ms in ``args``) from
  each culprit chunk to each stall it caused;
- counters (``"ph": "C"``, sampled at each step start): ``tokens`` (budget), ``tokens scheduled``
  (prefill, decode), ``KV blocks`` (used) and ``requests`` (running, waiting);
- names and order through metadata events (``"ph": "M"``).

Thread ids are unique in the whole trace and each run's ``pid`` is the tid of its steps thread
(Perfetto keys threads by tid alone).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from storage.export_read import ExportError


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
        self._last_flow = 0

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

    def flow(
        self, pid: int, src: tuple[int, float], dst: tuple[int, float], args: dict[str, Any]
    ) -> None:
        """An arrow from the slice around ``src`` (tid, time) to the one around ``dst``."""
        self._last_flow += 1
        common = {"name": "blame", "cat": "blame", "id": self._last_flow, "pid": pid}
        self.events.append({**common, "ph": "s", "tid": src[0], "ts": self.us(src[1]),
                            "args": args})  # fmt: skip
        self.events.append({**common, "ph": "f", "bp": "e", "tid": dst[0], "ts": self.us(dst[1]),
                            "args": args})  # fmt: skip

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


def chrome_trace(
    tables: dict[str, pd.DataFrame], links: pd.DataFrame | None = None
) -> dict[str, Any]:
    """The selection as a trace-event JSON object (see the module docstring). ``links``: the
    blame arrows (``engine_id``, ``run_id``, ``culprit``, ``culprit_step``, ``victim``,
    ``victim_step``, ``k``, ``ms``), none when None."""
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
            None if links is None else _of_run(links, engine_id, run_id),
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
    links: pd.DataFrame | None = None,
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

    # (request id, step) -> the middle of the request's chunk slice in that step
    chunk_at: dict[tuple[str, int], float] = {}
    for rid, tid in tids.items():
        req = info.get(rid)
        cls = req["traffic_class"] if req is not None else None
        label = f"req {rid}" + (f" [{cls}]" if cls else "")
        trace.meta("thread_name", pid, tid, {"name": label})
        trace.meta("thread_sort_index", pid, tid, {"sort_index": tid})
        spans = [step_times[int(c["step"])] for c in req_chunks.get(rid, [])]
        drawn = _request_events(trace, pid, tid, rid, req, req_chunks.get(rid, []), spans, token_of)
        chunk_at.update(((rid, step), t) for step, t in drawn.items())
        for tok in firsts.get(rid, []):
            t = _finite(tok["time"])
            if t is not None:
                args = {"request_id": rid, "k": 1, "step": _num(tok["step"])}
                trace.instant("first token", pid, tid, t, args)
    if links is not None and not links.empty:
        _blame_arrows(trace, pid, tids, chunk_at, links)


def _blame_arrows(
    trace: _Trace,
    pid: int,
    tids: dict[str, int],
    chunk_at: dict[tuple[str, int], float],
    links: pd.DataFrame,
) -> None:
    """A flow from each culprit chunk to the victim's token of the stall it caused (a link
    whose chunks are not in the selection is left out)."""
    for link in _records(links):
        culprit, victim = str(link["culprit"]), str(link["victim"])
        src = chunk_at.get((culprit, int(link["culprit_step"])))
        dst = chunk_at.get((victim, int(link["victim_step"])))
        if src is None or dst is None:
            continue
        args = {"culprit": culprit, "victim": victim, "token": int(link["k"]),
                "blamed_ms": round(float(link["ms"]), 3)}  # fmt: skip
        trace.flow(pid, (tids[culprit], src), (tids[victim], dst), args)


def _request_events(
    trace: _Trace,
    pid: int,
    tid: int,
    rid: str,
    r: dict[str, Any] | None,
    chunks: list[dict[str, Any]],
    spans: list[tuple[float, float]],
    token_of: dict[tuple[str, int], tuple[int, Any]],
) -> dict[int, float]:
    """The request's slice, its phases and its chunks, properly nested on its thread; returns
    the middle of each chunk slice drawn, by step."""
    drawn: dict[int, float] = {}
    known = [t for span in spans for t in span]
    arrival = first_scheduled = first_token = finished = None
    if r is not None:
        arrival = _finite(r["arrival"])
        first_scheduled = _finite(r["first_scheduled"])
        first_token = _finite(r["first_token"])
        finished = _finite(r["finished"])
        known += [t for t in (arrival, first_scheduled, first_token, finished) if t is not None]
    if not known:
        return drawn
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
        parents: list[tuple[str, float, float]] = _phases(begin, end, first_scheduled, first_token)
        for name, t0, t1 in parents:
            trace.slice(name, pid, tid, t0, t1, None)
    else:
        trace.slice(f"request {rid}", pid, tid, begin, end, {"request_id": rid})
        parents = []
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
        drawn[step] = (t0 + t1) / 2
    return drawn


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


def write_chrome_trace(
    tables: dict[str, pd.DataFrame], out: Path, links: pd.DataFrame | None = None
) -> Path:
    """The trace as JSON (gzip when ``out`` ends in ``.gz``), written atomically."""
    if out.exists() and out.is_dir():
        raise ExportError(f"--out {out} is a folder; for --format chrome-trace it names a file")
    doc = chrome_trace(tables, links)
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
