"""The fleet at a glance: every engine of the store, the collector it is connected to, its
settings, and how its last minute went (step rate, stalls, worst chat inter-token gap), worst
first. The dashboard's Fleet page reads it."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
from sqlalchemy import Engine

from storage import fleet, queries
from storage.stalls import stall_window

WINDOW_S = 60.0

COLUMNS = [
    "engine_id",
    "run_id",
    "collector",
    "connected",
    "model",
    "engine_kind",
    "token_budget",
    "max_token_budget",
    "long_prefill_token_threshold",
    "steps_per_s",
    "stalls",
    "worst_chat_itl_ms",
    "last_time",
]


def _last(frame: pd.DataFrame, column: str) -> Any:
    if frame.empty or column not in frame:
        return None
    values = frame[column].dropna()
    if values.empty:
        return None
    value = values.iloc[-1]
    return int(value) if isinstance(value, int | float) and value == value else value


def fleet_summary(db: Engine, *, window_s: float = WINDOW_S) -> pd.DataFrame:
    """One row per engine id (its newest run): the collector holding its connection (from
    the fleet's table; None for a store one collector writes), budget, cap, and over the last
    ``window_s`` seconds of its steps: steps per second, stalls of its chat streams and their
    worst inter-token gap. Sorted worst first: the longest chat gap (in whole milliseconds),
    then the most stalls; engines with no recent steps last."""
    runs = queries.engines(db)
    if runs.empty:
        return pd.DataFrame(columns=COLUMNS)
    newest = runs.drop_duplicates("engine_id", keep="first")  # runs come newest first
    routes = {row["engine_id"]: row for row in fleet.fleet_engines(db)}
    out = []
    for run in newest.to_dict("records"):
        engine_id, run_id = str(run["engine_id"]), str(run["run_id"])
        route = routes.get(engine_id)
        if route is not None and route.get("run_id") != run_id:
            route = None
        until = run.get("last_time")
        row: dict[str, Any] = {
            "engine_id": engine_id,
            "run_id": run_id,
            "collector": route.get("collector") if route else None,
            "connected": bool(route["connected"]) if route else bool(run.get("connected")),
            "model": run.get("model"),
            "engine_kind": run.get("engine_kind"),
            "token_budget": run.get("token_budget"),
            "max_token_budget": run.get("max_token_budget"),
            "long_prefill_token_threshold": None,
            "steps_per_s": 0.0,
            "stalls": 0,
            "worst_chat_itl_ms": None,
            "last_time": until,
        }
        if isinstance(until, float) and not math.isnan(until):
            since = until - window_s
            steps = queries.steps(db, engine_id=engine_id, run_id=run_id, since=since, until=until)
            if not steps.empty:
                row["steps_per_s"] = len(steps) / window_s
                row["token_budget"] = _last(steps, "token_budget") or row["token_budget"]
                row["long_prefill_token_threshold"] = _last(steps, "long_prefill_token_threshold")
                stalls = stall_window(
                    db, engine_id=engine_id, run_id=run_id, since=since, until=until + 1e-3
                )
                row["stalls"] = stalls.stalls
                row["worst_chat_itl_ms"] = stalls.gap_max_ms
        out.append(row)
    frame = pd.DataFrame(out, columns=COLUMNS)
    frame["_recent"] = frame["steps_per_s"] > 0
    # whole milliseconds: a gap a fraction of a millisecond longer is not worse
    frame["_worst"] = (
        pd.to_numeric(frame["worst_chat_itl_ms"], errors="coerce").fillna(-1.0).round()
    )
    frame = frame.sort_values(
        ["_recent", "_worst", "stalls", "engine_id"], ascending=[False, False, False, True]
    )
    return frame.drop(columns=["_recent", "_worst"]).reset_index(drop=True)
