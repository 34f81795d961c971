"""Blame arrows for the Chrome trace: for each stall in an export's selection, the culprit
chunks that caused it (``Ledger.stall_links``), which ``storage.chrome_trace`` draws as flow
arrows from the culprit's chunk to the victim's token. No torch."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pandas as pd

from advisor.blame import BlameError, Ledger, Window
from advisor.blame_store import LOOKBACK_S, fit_window
from engine.core.cost_model import CostModel

logger = logging.getLogger(__name__)

COLUMNS = ["engine_id", "run_id", "victim", "k", "victim_step", "culprit", "culprit_step", "ms"]
# at most this many arrows per run (the largest): a long busy window has stalls by thousands
MAX_LINKS = 5000
SLICE_S = 60.0


def _of_run(df: pd.DataFrame, engine_id: str, run_id: str) -> pd.DataFrame:
    if df.empty:
        return df
    return df[(df["engine_id"] == engine_id) & (df["run_id"] == run_id)]


def trace_links(
    db: Any, tables: dict[str, pd.DataFrame], max_links: int = MAX_LINKS
) -> pd.DataFrame:
    """Every run's stall links (``COLUMNS``), from the export's own tables; a run whose
    step-cost model cannot be fitted has none. A long selection is blamed ``SLICE_S`` at a
    time (each slice read from ``LOOKBACK_S`` before it, so a stall that began before the
    slice is whole), with one model fitted per run."""
    steps = tables["steps"]
    frames = []
    if steps.empty:
        return pd.DataFrame(columns=COLUMNS)
    for (engine_id, run_id), run_steps in steps.groupby(["engine_id", "run_id"], sort=False):
        eid, rid = str(engine_id), str(run_id)
        chunks = _of_run(tables["chunks"], eid, rid)
        requests = _of_run(tables["requests"], eid, rid)
        try:
            model = fit_window(db, Window(eid, rid, run_steps, chunks, requests)).model
        except BlameError as exc:
            logger.info("no blame arrows for %s/%s: %s", eid, rid, exc)
            continue
        start = run_steps["start"].to_numpy(dtype=np.float64)
        lo, hi = float(start.min()), float(start.max())
        for a in np.arange(lo, hi + SLICE_S / 2, SLICE_S):
            b = a + SLICE_S
            in_slice = (start >= a - LOOKBACK_S) & (start < b)
            links = _slice_links(run_steps[in_slice], chunks, requests, eid, rid, model)
            if links.empty:
                continue
            last_steps = run_steps.loc[in_slice & (start >= a), "step"]
            if last_steps.empty:
                continue
            # each stall once: in the slice its token's step starts in
            links = links[links["victim_step"] >= int(last_steps.min())]
            links.insert(0, "run_id", rid)
            links.insert(0, "engine_id", eid)
            frames.append(links)
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    out = pd.concat(frames, ignore_index=True)[COLUMNS]
    out = out.sort_values("ms", ascending=False, kind="stable")
    return out.groupby(["engine_id", "run_id"], sort=False).head(max_links).reset_index(drop=True)


def _slice_links(
    steps: pd.DataFrame,
    chunks: pd.DataFrame,
    requests: pd.DataFrame,
    engine_id: str,
    run_id: str,
    model: CostModel,
) -> pd.DataFrame:
    if steps.empty:
        return pd.DataFrame(columns=COLUMNS[2:])
    lo, hi = int(steps["step"].min()), int(steps["step"].max())
    chunks = chunks[(chunks["step"] >= lo) & (chunks["step"] <= hi)]
    if chunks.empty:
        return pd.DataFrame(columns=COLUMNS[2:])
    t0, t1 = float(steps["start"].min()), float(steps["end"].max())
    arrival = pd.to_numeric(requests["arrival"], errors="coerce")
    finished = pd.to_numeric(requests["finished"], errors="coerce")
    live = ~(arrival > t1) & ~(finished < t0)
    try:
        ledger = Ledger(Window(engine_id, run_id, steps, chunks, requests[live]), model)
    except BlameError:
        return pd.DataFrame(columns=COLUMNS[2:])
    return ledger.stall_links()
