"""The blame ledger's reads: a window of one run from the store, the step-cost model fitted to
it, and a request found by the id its client saw. Through ``storage.queries`` only; no torch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from advisor.blame import BlameError, Ledger, Window
from advisor.fit import FitError, FitReport, fit_steps, load_steps
from engine.core.cost_model import CostModel
from storage import queries

logger = logging.getLogger(__name__)

# a step in flight when a request arrived began at most this long before it (the steps read
# before a request's arrival); a longer one counts from where the read begins
LOOKBACK_S = 10.0
# fewer steps than this in the window: the model is fitted on the FIT_S seconds ending with it
MIN_FIT_STEPS = 200
FIT_S = 300.0
# at most this many steps are fitted on: every step with prefill, and decode-only steps evenly
# spread (a minute of a busy engine has thousands of decode steps that all say the same)
MAX_FIT_STEPS = 1500


@dataclass(frozen=True)
class Blamed:
    """A ledger and the fit it used."""

    ledger: Ledger
    fit: FitReport


def resolve_run(
    db: Engine, engine_id: str, run_id: str | None, since: float | None, until: float | None
) -> str:
    """``run_id``, or the engine's newest run with steps in [since, until]."""
    runs = queries.engines(db)
    runs = runs[runs["engine_id"] == engine_id]
    if runs.empty:
        known = ", ".join(sorted(set(queries.engines(db)["engine_id"]))[:10]) or "none"
        raise BlameError(f"no engine {engine_id!r} in the store (engines: {known})")
    if run_id is not None:
        if run_id not in set(runs["run_id"]):
            raise BlameError(f"engine {engine_id!r} has no run {run_id!r}")
        return run_id
    for rid in runs["run_id"]:  # newest first
        if not queries.steps(
            db, engine_id=engine_id, run_id=rid, since=since, until=until, limit=1
        ).empty:
            return str(rid)
    raise BlameError(f"engine {engine_id!r} ran no step in the window")


def read_window(
    db: Engine, engine_id: str, run_id: str, since: float | None, until: float | None
) -> Window:
    """The steps (those starting in [since, until]), their chunks and the requests of one run."""
    steps = queries.steps(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    if steps.empty:
        raise BlameError(f"no steps of {engine_id}/{run_id} in the window")
    chunks = queries.step_chunks(
        db,
        engine_id=engine_id,
        run_id=run_id,
        step_from=int(steps["step"].min()),
        step_to=int(steps["step"].max()),
    )
    reqs = queries.requests(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
    return Window(engine_id, run_id, steps, chunks, reqs)


def window_works(window: Window) -> pd.DataFrame:
    """The window's steps with their work as ``advisor.fit.load_steps`` gives it
    (``prefill_tokens``, ``decode_tokens``, ``attention_pairs``, ``decode_pairs``,
    ``image_tokens``, ``image_prefill_tokens``), counted with numpy over the chunks already
    read: what the fit needs, without reading the store again."""
    steps = window.steps.sort_values("step", kind="stable").reset_index(drop=True)
    chunks = window.chunks
    no = steps["step"].to_numpy(dtype=np.int64)
    idx = np.searchsorted(no, chunks["step"].to_numpy(dtype=np.int64))
    ok = (idx < len(no)) & (no[np.minimum(idx, max(len(no) - 1, 0))] == chunks["step"].to_numpy())
    idx = idx[ok]
    c = chunks[ok]
    n = c["num_tokens"].to_numpy(dtype=np.float64)
    s = c["start"].to_numpy(dtype=np.float64)
    decode = (c["kind"] == "decode").to_numpy()
    pairs = n * s + n * (n + 1) / 2
    reqs = window.requests
    img = pd.to_numeric(reqs["num_image_tokens"], errors="coerce").fillna(0)
    share = np.zeros(len(c))
    image_prefill = np.zeros(len(c))
    if (img > 0).any():
        prompt = pd.to_numeric(reqs["num_prompt_tokens"], errors="coerce").fillna(0)
        with_img = reqs[(img > 0) & (prompt > 0)]
        ratio = (img / prompt.where(prompt > 0, 1)).clip(upper=1.0)[with_img.index]
        by_id = dict(zip(with_img["request_id"].astype(str), ratio, strict=True))
        share = c["request_id"].astype(str).map(by_id).fillna(0.0).to_numpy(dtype=np.float64)
        image_prefill = np.where(~decode & (share > 0), n, 0.0)
    ns = len(no)

    def per_step(values: np.ndarray) -> np.ndarray:
        return np.bincount(idx, values, minlength=ns)

    out = steps.copy()
    out["prefill_tokens"] = per_step(np.where(decode, 0.0, n)).astype(np.int64)
    out["decode_tokens"] = per_step(np.where(decode, n, 0.0)).astype(np.int64)
    out["attention_pairs"] = per_step(pairs).astype(np.int64)
    out["decode_pairs"] = per_step(np.where(decode, pairs, 0.0)).astype(np.int64)
    out["image_prefill_tokens"] = per_step(image_prefill).astype(np.int64)
    out["image_tokens"] = np.round(per_step(np.where(decode, 0.0, n * share))).astype(np.int64)
    return out


def fit_window(db: Engine, window: Window) -> FitReport:
    """The step-cost model fitted to the window's steps, or to the ``FIT_S`` seconds ending
    with them when the window holds fewer than ``MIN_FIT_STEPS``."""
    steps = window.steps
    if len(steps) >= MIN_FIT_STEPS:
        merged = window_works(window)
    else:
        until = float(steps["end"].max())
        since = min(float(steps["start"].min()), until - FIT_S)
        merged = load_steps(
            db, engine_id=window.engine_id, run_id=window.run_id, since=since, until=until
        )
    merged = thin(merged, MAX_FIT_STEPS)
    try:
        return fit_steps(
            merged, {"engine_id": window.engine_id, "run_id": window.run_id}, resamples=0
        )
    except FitError as exc:
        raise BlameError(f"cannot fit the step-cost model: {exc}") from exc


def thin(steps: pd.DataFrame, limit: int) -> pd.DataFrame:
    """``steps`` with every step that had prefill and evenly spread decode-only steps, at most
    ``limit`` in all (the prefill steps are kept even beyond it)."""
    if len(steps) <= limit:
        return steps
    prefill = steps["prefill_tokens"].to_numpy() > 0
    decode = np.flatnonzero(~prefill)
    room = max(limit - int(prefill.sum()), min(len(decode), 100))
    keep = prefill.copy()
    if len(decode):
        keep[decode[np.linspace(0, len(decode) - 1, min(room, len(decode))).astype(np.int64)]] = (
            True
        )
    return steps[keep]


def blame_window(
    db: Engine,
    *,
    engine_id: str,
    run_id: str | None = None,
    since: float | None = None,
    until: float | None = None,
    fit: FitReport | None = None,
) -> Blamed:
    """The ledger of one run's window (the engine's newest run with steps there by default)."""
    if since is not None and until is not None and not until > since:
        raise BlameError(f"need --until after --since, got {since} and {until}")
    run = resolve_run(db, engine_id, run_id, since, until)
    window = read_window(db, engine_id, run, since, until)
    report = fit if fit is not None else fit_window(db, window)
    return Blamed(Ledger(window, report.model), report)


def request_ids(request_id: str) -> list[str]:
    """The ids a request may be stored under: as given, and for a chat completion's id
    (``chatcmpl-X``) the engine's ``cmpl-X`` (chunkscope's engine answers a chat completion
    with ``chat`` before its request id)."""
    out = [request_id]
    if request_id.startswith("chatcmpl-"):
        out.append(request_id[len("chat") :])
    return out


def find_request(
    db: Engine, engine_id: str, request_id: str, run_id: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The stored id and the request's row (the newest run holding it)."""
    for rid in request_ids(request_id):
        times = queries.token_times(db, engine_id=engine_id, run_id=run_id, request_id=rid)
        if times.empty:
            continue
        lo, hi = float(times["time"].min()), float(times["time"].max())
        reqs = queries.requests(db, engine_id=engine_id, run_id=run_id, since=lo, until=hi)
        rows = reqs[reqs["request_id"] == rid]
        if not rows.empty:
            return rid, {**rows.iloc[-1].to_dict(), "last_token": hi}
    # a request that never produced a token: look through the engine's requests
    reqs = queries.requests(db, engine_id=engine_id, run_id=run_id)
    for rid in request_ids(request_id):
        rows = reqs[reqs["request_id"] == rid]
        if not rows.empty:
            return rid, rows.iloc[-1].to_dict()
    raise BlameError(f"no request {request_id!r} of engine {engine_id!r} in the store")


def blame_request(
    db: Engine,
    *,
    engine_id: str,
    request_id: str,
    run_id: str | None = None,
    fit: FitReport | None = None,
) -> tuple[dict[str, Any], Blamed]:
    """What slowed one request (``Ledger.request``), read over its life, and the ledger."""
    rid, row = find_request(db, engine_id, request_id, run_id)
    run = str(row["run_id"])
    begin = _first(row, "arrival", "first_scheduled", "first_token")
    # to its end, or (still running) to its last token so far
    end = _first(row, "finished", "last_token", "first_token", "first_scheduled")
    if begin is None or end is None:
        raise BlameError(f"request {request_id!r} has no times in the store")
    window = read_window(db, engine_id, run, begin - LOOKBACK_S, max(end, begin))
    report = fit if fit is not None else fit_window(db, window)
    ledger = Ledger(window, report.model)
    out = ledger.request(rid)
    if rid != request_id:
        out["stored_request_id"] = rid
        out["request_id"] = request_id
    return out, Blamed(ledger, report)


def _first(row: dict[str, Any], *names: str) -> float | None:
    for name in names:
        v = row.get(name)
        if v is not None and not pd.isna(v):
            return float(v)
    return None


def fit_recent(
    db: Engine, *, engine_id: str, run_id: str, until: float, span_s: float = FIT_S
) -> FitReport:
    """The step-cost model of the ``span_s`` seconds of one run ending at ``until`` (for the
    ledger of a few gaps, too few steps to fit on)."""
    steps = thin(
        load_steps(db, engine_id=engine_id, run_id=run_id, since=until - span_s, until=until),
        MAX_FIT_STEPS,
    )
    try:
        return fit_steps(steps, {"engine_id": engine_id, "run_id": run_id}, resamples=0)
    except FitError as exc:
        raise BlameError(f"cannot fit the step-cost model: {exc}") from exc


def blame_tokens(
    db: Engine, *, engine_id: str, run_id: str, tokens: pd.DataFrame, model: CostModel
) -> pd.DataFrame:
    """The ledger of the gaps before some tokens of one run (``tokens``: ``request_id``,
    ``step``, ``time`` and ``itl_ms``, as ``queries.token_itl`` gives them), read from the
    store over those gaps only: per token, ``gap_ms``, ``excess_ms`` and ``culprits`` (the
    largest three, (request id, ms) each), with the culprits' ``classes`` and ``prompts``
    (request id -> traffic class, prompt tokens). A token whose gap the window does not hold
    is left out."""
    cols = ["request_id", "step", "gap_ms", "excess_ms", "culprits", "classes", "prompts"]
    if tokens.empty:
        return pd.DataFrame(columns=cols)
    begin = tokens["time"].to_numpy(dtype=np.float64) - tokens["itl_ms"].to_numpy() / 1e3
    lo, hi = float(begin.min()), float(tokens["time"].max())
    ledger = Ledger(read_window(db, engine_id, run_id, lo, hi), model)
    out = ledger.token_gaps(tokens)
    info = {c: ledger.request_info(ledger.index[c]) for cs in out["culprits"] for c, _ in cs}
    out["classes"] = [{c: info[c]["traffic_class"] for c, _ in cs} for cs in out["culprits"]]
    out["prompts"] = [{c: info[c]["num_prompt_tokens"] for c, _ in cs} for cs in out["culprits"]]
    return out[cols]
