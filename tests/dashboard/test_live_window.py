"""The Live page's incremental window against an in-memory stand-in for ``storage.queries``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

from dashboard.live import LiveWindow, RefreshPace
from tests.dashboard.frames import T0, itl_frame, steps_frame


class FakeQueries:
    """``steps`` and ``token_itl`` with the API's filters over frames the test appends to."""

    def __init__(self) -> None:
        self.steps_df = steps_frame(0)
        self.itl_df = itl_frame([])
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def add_steps(self, df: pd.DataFrame) -> None:
        self.steps_df = pd.concat([self.steps_df, df], ignore_index=True)

    def add_itl(self, df: pd.DataFrame) -> None:
        self.itl_df = pd.concat([self.itl_df, df], ignore_index=True)

    def steps(self, db: Any, *, engine_id=None, run_id=None, since=None, after_step=None, **kw):
        self.calls.append(("steps", {"run_id": run_id, "since": since, "after_step": after_step}))
        df = self.steps_df
        if engine_id is not None:
            df = df[df["engine_id"] == engine_id]
        if run_id is not None:
            df = df[df["run_id"] == run_id]
        if since is not None:
            df = df[df["end"] >= since]
        if after_step is not None:
            df = df[df["step"] > after_step]
        return df.sort_values(["run_id", "step"]).reset_index(drop=True)

    def token_itl(self, db: Any, *, engine_id=None, run_id=None, since=None, after_time=None, **kw):
        self.calls.append(("token_itl", {"since": since, "after_time": after_time}))
        df = self.itl_df
        if run_id is not None:
            df = df[df["run_id"] == run_id]
        if since is not None:
            df = df[df["time"] >= since]
        if after_time is not None:
            df = df[df["time"] > after_time]
        return df.sort_values("time").reset_index(drop=True)


def test_reads_only_new_rows_and_keeps_the_window() -> None:
    q = FakeQueries()
    q.add_steps(steps_frame(20, prefill_every=0))  # 10 ms steps from T0
    q.add_itl(itl_frame([10.0] * 5))
    lw = LiveWindow(engine_id="e1", run_ids=(("e1", "r1"),), window_s=60)
    new = lw.refresh(q, None, latest=float(q.steps_df["end"].max()))
    assert new == 25
    assert lw.last_step[("e1", "r1")] == 19
    first_steps_call = q.calls[0][1]
    assert first_steps_call["since"] is not None and first_steps_call["after_step"] is None

    # nothing new: zero rows, and the next read asks only after what it holds
    assert lw.refresh(q, None, latest=None) == 0
    steps_calls = [c for name, c in q.calls if name == "steps"]
    assert steps_calls[-1]["after_step"] == 19
    itl_calls = [c for name, c in q.calls if name == "token_itl"]
    assert itl_calls[-1]["after_time"] is not None

    more = steps_frame(30, prefill_every=0)
    more = more[more["step"] >= 20].copy()
    q.add_steps(more)
    assert lw.refresh(q, None, latest=None) == 10
    assert lw.steps["step"].tolist() == list(range(30))


def test_overlapping_itl_reads_do_not_double_rows() -> None:
    q = FakeQueries()
    q.add_steps(steps_frame(3, prefill_every=0))
    q.add_itl(itl_frame([10.0, 11.0, 12.0]))
    lw = LiveWindow(engine_id=None, run_ids=(("e1", "r1"),), window_s=60, overlap_s=5.0)
    lw.refresh(q, None, latest=T0 + 1)
    assert len(lw.itl) == 3
    # a late row with an earlier time than the newest held (another engine's batch) is kept
    late = itl_frame([99.0], t0=T0 + 0.05)
    late["request_id"] = "late"
    q.add_itl(late)
    lw.refresh(q, None, latest=None)
    assert len(lw.itl) == 4
    assert sorted(lw.itl["itl_ms"].tolist()) == [10.0, 11.0, 12.0, 99.0]


def test_old_rows_fall_out_of_the_window() -> None:
    q = FakeQueries()
    q.add_steps(steps_frame(5, prefill_every=0))
    lw = LiveWindow(engine_id="e1", run_ids=(("e1", "r1"),), window_s=10)
    lw.refresh(q, None, latest=T0 + 0.05)
    later = steps_frame(5, t0=T0 + 100, prefill_every=0)
    later["step"] = range(5, 10)
    q.add_steps(later)
    lw.refresh(q, None, latest=None)
    assert lw.steps["step"].tolist() == [5, 6, 7, 8, 9]
    lo, hi = lw.window()
    assert hi - lo == 10


def test_empty_store_then_first_steps() -> None:
    q = FakeQueries()
    lw = LiveWindow(engine_id="e1", run_ids=(("e1", "r1"),))
    assert lw.refresh(q, None, latest=None) == 0
    assert lw.horizon is None and lw.window() is None
    q.add_steps(steps_frame(2, prefill_every=0))
    assert lw.refresh(q, None, latest=None) == 2


def test_all_engines_reads_each_run_and_only_selected_runs() -> None:
    q = FakeQueries()
    q.add_steps(steps_frame(3, prefill_every=0, run="r1"))
    q.add_steps(steps_frame(4, prefill_every=0, run="r2"))
    other = itl_frame([1.0, 2.0])
    other["run_id"] = "r9"
    q.add_itl(other)
    q.add_itl(itl_frame([5.0]))
    lw = LiveWindow(engine_id=None, run_ids=(("e1", "r1"), ("e1", "r2")))
    lw.refresh(q, SimpleNamespace(), latest=None)
    assert lw.last_step == {("e1", "r1"): 2, ("e1", "r2"): 3}
    assert len(lw.steps) == 7
    assert lw.itl["run_id"].tolist() == ["r1"]
    assert lw.matches(None, (("e1", "r2"), ("e1", "r1")))


def test_the_pace_slows_only_after_two_slow_redraws_in_a_row_and_returns_when_they_are_cheap() -> (
    None
):
    pace = RefreshPace(base_s=1.0, max_s=4.0)
    assert not pace.observe(0.9)  # one slow redraw (> half the interval): not yet
    assert not pace.observe(0.1)  # the streak is broken
    assert not pace.observe(0.6)
    assert pace.observe(0.7) and pace.interval_s == 2.0 and pace.slowed
    assert not pace.observe(1.5) and pace.observe(1.5) and pace.interval_s == 4.0
    assert not pace.observe(3.0) and not pace.observe(3.0)  # at max_s it holds
    assert not pace.observe(1.0) and not pace.observe(1.0)  # between the thresholds: holds
    assert not pace.observe(0.1) and pace.observe(0.1) and pace.interval_s == 2.0
    assert not pace.observe(0.2) and pace.observe(0.2) and pace.interval_s == 1.0
    assert not pace.slowed
    assert not pace.observe(0.0) and not pace.observe(0.0)  # never below base_s


def test_a_halved_interval_does_not_bounce_back_up() -> None:
    # a redraw just under the fast threshold at 2 s stays under the slow one at 1 s
    pace = RefreshPace(base_s=1.0, max_s=8.0, interval_s=2.0)
    assert not pace.observe(0.29) and pace.observe(0.29) and pace.interval_s == 1.0
    assert not pace.observe(0.29) and not pace.observe(0.29) and pace.interval_s == 1.0


@pytest.mark.parametrize(
    "kwargs", [{"base_s": 0.0}, {"base_s": 2.0, "max_s": 1.0}, {"fast": 0.3}, {"fast": 0.0}]
)
def test_a_pace_that_could_flap_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RefreshPace(**kwargs)


def test_coarsen_steps_bounds_the_rows_and_keeps_every_tall_step() -> None:
    import numpy as np

    from dashboard.live import coarsen_steps

    n = 20_000
    start = np.arange(n) * 0.003  # a minute of 3 ms steps...
    end = start + 0.002
    prefill = np.zeros(n, dtype=np.int64)
    prefill[[100, 7_000, 15_000]] = [4096, 256, 1500]  # ...with three prefills among them
    end[7_000] = start[7_000] + 0.5  # one of them a wide step
    steps = pd.DataFrame(
        {
            "step": np.arange(n), "start": start, "end": end, "engine_id": "e", "run_id": "r",
            "num_decode_tokens": 4, "num_prefill_tokens": prefill, "token_budget": 4096,
            "duration_ms": (end - start) * 1000, "num_running": 4, "num_waiting": 0,
            "kv_blocks_used": 10, "kv_blocks_total": 100,
        }
    )  # fmt: skip
    out = coarsen_steps(steps, max_steps=500)
    assert out is not None and len(out) <= 502 and list(out.columns) == list(steps.columns)
    assert sorted(out["num_prefill_tokens"].nlargest(3)) == [256, 1500, 4096]
    wide = out[out["duration_ms"] >= 400]
    assert len(wide) == 1 and wide.iloc[0]["step"] == 7_000  # the wide step stays itself
    assert out["start"].is_monotonic_increasing and out["end"].max() == steps["end"].max()
    assert coarsen_steps(steps.head(100), max_steps=500) is not None
    assert len(coarsen_steps(steps.head(100), max_steps=500)) == 100  # type: ignore[arg-type]
