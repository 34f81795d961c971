"""storage.queries on a store written directly through the writer's Store: empty results keep
their columns, windows and filters select the right rows."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from storage import db as dbm
from storage import queries
from storage.store import CollectorControl, Events, Hello, Store
from testkit.engines import SyntheticEngine

ALL = {
    "engines": queries.ENGINES_COLUMNS,
    "steps": queries.STEPS_COLUMNS,
    "step_chunks": queries.STEP_CHUNKS_COLUMNS,
    "requests": queries.REQUESTS_COLUMNS,
    "token_itl": queries.TOKEN_ITL_COLUMNS,
    "token_times": queries.TOKEN_TIMES_COLUMNS,
    "latency_summary": queries.LATENCY_SUMMARY_COLUMNS,
    "controls": queries.CONTROLS_COLUMNS,
    "gaps": queries.GAPS_COLUMNS,
}
ARGS: dict[str, dict[str, Any]] = {
    "step_chunks": {"step_from": 0, "step_to": 10},
    "token_times": {"request_id": "nope"},
}


@pytest.fixture
def store(db_url: str) -> Any:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    s = Store(db)
    yield s
    s.close()
    db.dispose()


@pytest.fixture
def reader(db_url: str, store: Store) -> Any:
    db = dbm.connect(db_url, readonly=True)
    yield db
    db.dispose()


def _write(store: Store, eng: SyntheticEngine, n_steps: int) -> None:
    [info] = store.apply([Hello(eng.hello())])
    events = eng.steps(n_steps)
    for i in range(0, len(events), 200):
        store.apply([Events(info.run_key, events[i : i + 200])])


@pytest.mark.parametrize("name", sorted(ALL))
def test_empty_store_returns_columns(reader: Any, name: str) -> None:
    df = getattr(queries, name)(reader, **ARGS.get(name, {}))
    assert df.empty and list(df.columns) == ALL[name]


def test_windows_and_filters(store: Store, reader: Any) -> None:
    a = SyntheticEngine(engine_id="engine-a", run_id="run-a1", seed=1, concurrency=8)
    b = SyntheticEngine(
        engine_id="engine-b", run_id="run-b1", seed=2, concurrency=8, classes=("chat",)
    )
    _write(store, a, 200)
    _write(store, b, 100)
    assert list(queries.engines(reader).engine_id) == ["engine-b", "engine-a"]  # newest first
    for name, cols in ALL.items():
        df = getattr(queries, name)(reader, **ARGS.get(name, {}))
        assert list(df.columns) == cols, name

    all_a = queries.steps(reader, engine_id="engine-a")
    assert len(all_a) == 200 and set(all_a.engine_id) == {"engine-a"}
    assert len(queries.steps(reader)) == 300
    since, until = all_a.start.iloc[50], all_a.start.iloc[99]
    win = queries.steps(reader, engine_id="engine-a", since=since, until=until)
    assert list(win.step) == list(range(50, 100))
    assert list(queries.steps(reader, engine_id="engine-a", after_step=195).step) == [
        196,
        197,
        198,
        199,
    ]
    assert list(queries.steps(reader, run_id="run-a1", limit=3).step) == [197, 198, 199]

    itl = queries.token_itl(reader, engine_id="engine-a", since=since, until=until)
    assert set(itl.step) <= set(range(50, 100)) and len(itl) > 0
    later = queries.token_itl(reader, engine_id="engine-a", after_time=itl.time.iloc[-1] - 1e-6)
    assert later.time.min() >= itl.time.iloc[-1] - 1e-6
    assert set(queries.token_itl(reader, traffic_class="chat").traffic_class) == {"chat"}
    b_reqs = queries.requests(reader, engine_id="engine-b", traffic_class="chat")
    assert len(b_reqs) > 0 and set(b_reqs.engine_id) == {"engine-b"}
    assert queries.requests(reader, engine_id="engine-b", traffic_class="rag").empty

    summary = queries.latency_summary(reader, engine_id="engine-a", since=since, until=until)
    summary = summary.set_index("traffic_class")
    assert summary.loc["all", "output_tokens"] == len(
        queries.token_itl(reader, engine_id="engine-a", since=since, until=until)
    ) + int(_tokens_k1(reader, "engine-a", since, until))
    assert summary.loc["all", "tokens_per_s"] == pytest.approx(
        summary.loc["all", "output_tokens"] / (until - since)
    )
    for cls in ("chat", "rag", "vlm"):
        assert summary.loc[cls, "itl_p50_ms"] <= summary.loc[cls, "itl_p99_ms"]


def _tokens_k1(reader: Any, engine_id: str, since: float, until: float) -> int:
    ch = queries.step_chunks(reader, engine_id=engine_id, step_from=0, step_to=10**9)
    st = queries.steps(reader, engine_id=engine_id, since=since, until=until)
    ch = ch[ch.step.isin(set(st.step)) & ch.produced_token]
    firsts = 0
    for rid, group in ch.groupby("request_id"):
        tt = queries.token_times(reader, engine_id=engine_id, request_id=rid)
        firsts += int(((tt.k == 1) & tt.step.isin(set(group.step))).sum())
    return firsts


def test_controls_from_collector_and_engine(store: Store, reader: Any) -> None:
    eng = SyntheticEngine(engine_id="engine-c", run_id="run-c", seed=3)
    [info] = store.apply([Hello(eng.hello())])
    events = eng.steps(5)
    eng.control("token_budget", 128, source="api")
    events += eng.steps(5)
    store.apply([Events(info.run_key, events)])
    store.apply(
        [
            CollectorControl(
                "engine-c",
                "run-c",
                "token_budget",
                128,
                0,
                "token_budget must be from 1 to 16384, got 0",
                "c9",
            )
        ]
    )
    ctl = queries.controls(reader, engine_id="engine-c")
    assert sorted(ctl.accepted) == [False, True]
    acc = ctl[ctl.accepted].iloc[0]
    assert acc.applied_at_step == 5 and acc.new_value == 128 and acc.source == "api"
    st = queries.steps(reader, engine_id="engine-c")
    assert acc.applied_at == pytest.approx(st[st.step == 5].start.iloc[0])
    assert list(st.token_budget) == [512] * 5 + [128] * 5
    ref = ctl[~ctl.accepted].iloc[0]
    assert ref.source == "collector" and ref.request_id == "c9" and pd.isna(ref.time_ns)
    assert (ref.old_value, ref.new_value) == (128, 0)
    assert queries.engines(reader).iloc[0].token_budget == 128


def test_requests_without_a_class_are_unknown_in_the_summary(store: Store, reader: Any) -> None:
    eng = SyntheticEngine(engine_id="engine-u", run_id="run-u", seed=4, classes=("chat",))
    [info] = store.apply([Hello(eng.hello())])
    events = eng.steps(60)
    for ev in events:
        if ev["type"] == "request" and ev["request_id"].endswith(("1", "3")):
            ev["traffic_class"] = None
    store.apply([Events(info.run_key, events)])
    summary = queries.latency_summary(reader)
    assert list(summary.traffic_class) == ["chat", "unknown", "all"]
    by = summary.set_index("traffic_class")
    assert (
        by.loc["all", "num_requests"]
        == by.loc["chat", "num_requests"] + by.loc["unknown", "num_requests"]
    )
