"""The Live page's incremental window: read only the rows not read yet, keep the last minute.

Steps are read per run with ``after_step`` (exact: steps of one run are stored in order).
Inter-token latencies are read with ``after_time`` a little before the newest time already held
(``overlap_s``) and de-duplicated on (engine, run, request, k): with several engines, one engine's
batch can land after another's later tokens. No Streamlit here: the page keeps one
:class:`LiveWindow` per browser session and calls :meth:`LiveWindow.refresh` at each redraw.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

logger = logging.getLogger(__name__)

ITL_KEY = ["engine_id", "run_id", "request_id", "k"]
# The window start of the Live page's summary and controls queries sits on this grid (seconds),
# so their cached answers are reused between refreshes while the start has not moved.
SUMMARY_GRID_S = 5.0


@dataclass
class LiveWindow:
    """Steps and ITL rows of the last ``window_s`` seconds of data for one engine selection."""

    engine_id: str | None
    run_ids: tuple[tuple[str, str], ...]
    window_s: float = 60.0
    overlap_s: float = 2.0
    steps: pd.DataFrame | None = None
    itl: pd.DataFrame | None = None
    last_step: dict[tuple[str, str], int] = field(default_factory=dict)
    last_itl_time: float | None = None
    reads: int = 0

    def matches(self, engine_id: str | None, run_ids: tuple[tuple[str, str], ...]) -> bool:
        return self.engine_id == engine_id and set(self.run_ids) == set(run_ids)

    @property
    def horizon(self) -> float | None:
        """Newest step end held (the right edge of the charts)."""
        if self.steps is None or self.steps.empty:
            return None
        return float(self.steps["end"].max())

    def refresh(self, queries: ModuleType | Any, db: Any, *, latest: float | None) -> int:
        """Read what is new since the last call; ``latest`` is the newest data time the store
        knows for this selection (where a first read starts: ``latest - window_s``). Returns the
        number of new step and ITL rows."""
        new_rows = 0
        parts = [] if self.steps is None else [self.steps]
        empty: pd.DataFrame | None = None
        for eid, rid in self.run_ids:
            after = self.last_step.get((eid, rid))
            if after is None:
                since = None if latest is None else latest - self.window_s
                got = queries.steps(db, engine_id=eid, run_id=rid, since=since)
            else:
                got = queries.steps(db, engine_id=eid, run_id=rid, after_step=after)
            empty = got.iloc[0:0] if empty is None else empty
            if not got.empty:
                self.last_step[(eid, rid)] = int(got["step"].max())
                parts.append(got)
                new_rows += len(got)
            elif after is None:
                # Nothing in the first window (no data yet): read from the run's start next time.
                self.last_step[(eid, rid)] = -1
        self.steps = _concat(parts)
        if self.steps.empty and empty is not None:
            self.steps = empty  # keep the columns of an empty answer
        self.reads += 1

        if self.last_itl_time is None:
            since = None if latest is None else latest - self.window_s
            itl = queries.token_itl(
                db, engine_id=self.engine_id, run_id=self._single_run(), since=since
            )
        else:
            itl = queries.token_itl(
                db,
                engine_id=self.engine_id,
                run_id=self._single_run(),
                after_time=self.last_itl_time - self.overlap_s,
            )
        itl = self._only_selected(itl)
        if not itl.empty:
            held = self.itl is not None and not self.itl.empty
            before = len(self.itl) if self.itl is not None and held else 0
            merged = pd.concat([self.itl, itl], ignore_index=True) if held else itl
            self.itl = merged.drop_duplicates(subset=ITL_KEY, keep="first").reset_index(drop=True)
            new_rows += len(self.itl) - before
            self.last_itl_time = float(self.itl["time"].max())
        elif self.itl is None:
            self.itl = itl
        self._trim()
        return new_rows

    def _single_run(self) -> str | None:
        return self.run_ids[0][1] if len(self.run_ids) == 1 else None

    def _only_selected(self, itl: pd.DataFrame) -> pd.DataFrame:
        if itl.empty or len(self.run_ids) <= 1:
            return itl
        keys = pd.MultiIndex.from_frame(itl[["engine_id", "run_id"]])
        return itl[keys.isin(list(self.run_ids))]

    def _trim(self) -> None:
        edge = self.horizon
        if edge is None:
            return
        start = edge - self.window_s
        assert self.steps is not None
        self.steps = self.steps[self.steps["end"] >= start].reset_index(drop=True)
        if self.itl is not None and not self.itl.empty:
            self.itl = self.itl[self.itl["time"] >= start].reset_index(drop=True)

    def window(self) -> tuple[float, float] | None:
        edge = self.horizon
        return None if edge is None else (edge - self.window_s, edge)


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    parts = [p for p in parts if p is not None and not p.empty]
    if not parts:
        return pd.DataFrame()
    if len(parts) == 1:
        return parts[0].reset_index(drop=True)
    return pd.concat(parts, ignore_index=True)


@dataclass
class RefreshPace:
    """How often the Live page redraws: every ``base_s`` while a redraw is cheap, slower while it
    is not. On a saturated machine a redraw can take longer than its interval; the page's reruns
    then queue ahead of everything else in the session, a click in the sidebar included. Two
    redraws in a row longer than half the interval double it (up to ``max_s``); two in a row under
    ``fast`` of it halve it again (down to ``base_s``): between the two thresholds it holds."""

    base_s: float = 1.0
    max_s: float = 8.0
    slow: float = 0.5
    fast: float = 0.15
    interval_s: float = 0.0
    last_redraw_s: float | None = None
    _streak: int = 0  # > 0: slow redraws in a row; < 0: fast ones

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"need 0 < base_s <= max_s, got {self.base_s} and {self.max_s}")
        if not 0 < self.fast < self.slow / 2:
            # halving must not land a redraw of the fast side on the slow side
            raise ValueError(f"need 0 < fast < slow / 2, got {self.fast} and {self.slow}")
        self.interval_s = self.interval_s or self.base_s

    @property
    def slowed(self) -> bool:
        return self.interval_s > self.base_s

    def observe(self, redraw_s: float) -> bool:
        """One redraw took ``redraw_s`` seconds. True when the interval changed."""
        self.last_redraw_s = redraw_s
        if redraw_s > self.slow * self.interval_s and self.interval_s < self.max_s:
            self._streak = max(self._streak, 0) + 1
        elif redraw_s < self.fast * self.interval_s and self.interval_s > self.base_s:
            self._streak = min(self._streak, 0) - 1
        else:
            self._streak = 0
        if self._streak >= 2:
            self.interval_s = min(self.max_s, self.interval_s * 2)
        elif self._streak <= -2:
            self.interval_s = max(self.base_s, self.interval_s / 2)
        else:
            return False
        self._streak = 0
        return True


DRAW_STEPS = 600  # the most steps a Live chart draws (about one per pixel column)


def coarsen_steps(steps: pd.DataFrame | None, max_steps: int = DRAW_STEPS) -> pd.DataFrame | None:
    """At most about ``max_steps`` rows to draw: runs of steps shorter than the window's width /
    ``max_steps`` merge into one row per slice (first start, last end, the largest token counts,
    duration, queue and KV use of the slice), so every tall step still shows, while a step as
    wide as a slice or wider stays as it is. A minute of fast steps is tens of thousands of rows:
    drawn as they are, each redraw would ship megabytes to the browser."""
    if steps is None or len(steps) <= max_steps or max_steps < 1:
        return steps
    start = steps["start"].to_numpy(dtype="float64")
    end = steps["end"].to_numpy(dtype="float64")
    width = (float(end.max()) - float(start.min())) / max_steps
    if not width > 0:
        return steps
    slot = np.floor((start - start.min()) / width).astype(np.int64)
    wide = (end - start) >= width
    # a wide step is its own group; short steps group by slot (and never with a wide one)
    key = np.where(wide, -1 - np.arange(len(steps)), slot)
    group = np.cumsum(np.r_[True, key[1:] != key[:-1]])
    agg: dict[str, Any] = {c: "max" for c in steps.columns}
    for col in ("start", "step", "engine_id", "run_id", "policy"):
        if col in agg:
            agg[col] = "first"
    for col in ("end", "token_budget", "long_prefill_token_threshold", "kv_blocks_total"):
        if col in agg:
            agg[col] = "last"
    out = steps.groupby(group, sort=False).agg(agg).reset_index(drop=True)
    return out[steps.columns]
