"""The Live page's stalls lead to their culprits: each ringed token's hover names the requests
that caused it and the ms blamed on each, the stalls are blamed once (a redraw with no new
stall reads nothing) and a picker opens the Requests page on the stalled request or its
culprit. AppTest against a store seeded through a real collector (the scripted stall story:
four chat streams, a 2,000-token RAG prompt at steps 10, 60, 130 and 180)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard.live_blame import MAX_NEW, StallBlame, stall_choices
from testkit.seed import SynthRun, send_run

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    from testkit.collector import start_collector

    db_url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'chunkscope.db'}"
    collector = start_collector(db_url)
    try:
        send_run(collector.url, SynthRun())
        yield collector.url, db_url
    finally:
        collector.stop()


def _app(monkeypatch: pytest.MonkeyPatch, collector_url: str, db_url: str) -> AppTest:
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
    return AppTest.from_file(APP, default_timeout=60)


def _stall_trace(at: AppTest) -> dict[str, Any]:
    for chart in at.get("plotly_chart"):
        spec = json.loads(chart.proto.spec)
        if spec["layout"]["title"]["text"].startswith("Inter-token latency"):
            return next(t for t in spec["data"] if t.get("name") == "stall")
    raise AssertionError("no inter-token latency chart")


def test_a_stall_names_its_culprit_and_opens_the_requests_page(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    assert not at.exception, at.exception
    assert [h.value for h in at.header] == ["Live"]
    rings = _stall_trace(at)
    y = rings["y"]  # plotly ships the numbers base64-encoded
    n = len(base64.b64decode(y["bdata"])) // 8 if isinstance(y, dict) else len(y)
    assert rings["text"] and len(rings["text"]) == n
    assert "%{text}" in rings["hovertemplate"]
    # every chat stall of the story was a long prompt's prefill: its hover names the prompt
    named = [t for t in rings["text"] if "rag-" in t]
    assert len(named) >= 4 and len(named) >= 0.9 * len(rings["text"]), rings["text"]
    assert all("(rag, 2,000 tokens): " in t and " ms" in t for t in named)
    assert not any(": 0 ms" in t for t in named)  # a culprit of a few ms is not listed
    blame: StallBlame = at.session_state["live_stall_blame"]
    reads = blame.reads
    assert reads >= 1
    # a redraw with the same stalls reads nothing
    at.run()
    assert not at.exception, at.exception
    assert at.session_state["live_stall_blame"].reads == reads
    # the picker: the newest stall first; open its culprit, then (back on Live) its victim
    pick = at.selectbox(key="live_stall_pick")
    assert pick.options and all(" by rag-" in o for o in pick.options)
    victim = pick.value.split(" · ")[1].split(" token ")[0]
    culprit = pick.value.split(" by ")[1].split(" (")[0]
    at.button(key="live_open_culprit").click().run()
    assert not at.exception, at.exception
    assert [h.value for h in at.header] == ["Requests"]
    assert at.selectbox(key="request_pick").value == culprit
    at.switch_page("views/live.py").run()
    at.button(key="live_open_victim").click().run()
    assert [h.value for h in at.header] == ["Requests"]
    assert at.selectbox(key="request_pick").value == victim


def _stalls(n: int, t0: float = 1000.0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "engine_id": "e",
            "run_id": "r",
            "request_id": [f"chat-{i % 3}" for i in range(n)],
            "traffic_class": "chat",
            "k": [10 + i for i in range(n)],
            "time": [t0 + 0.5 * i for i in range(n)],
            "itl_ms": 400.0,
            "step": [100 + 10 * i for i in range(n)],
        }
    )


def _fake(calls: list[pd.DataFrame]) -> Any:
    def compute(engine_id: str, run_id: str, tokens: pd.DataFrame) -> pd.DataFrame:
        calls.append(tokens)
        return pd.DataFrame(
            {
                "request_id": tokens["request_id"],
                "step": tokens["step"],
                "gap_ms": 400.0,
                "excess_ms": 380.0,
                "culprits": [[("rag-1", 350.0), ("chat-9", 30.0)]] * len(tokens),
                "classes": [{"rag-1": "rag", "chat-9": "chat"}] * len(tokens),
                "prompts": [{"rag-1": 2000, "chat-9": 50}] * len(tokens),
            }
        )

    return compute


def test_stalls_are_blamed_once_newest_first_and_forgotten_when_gone() -> None:
    calls: list[pd.DataFrame] = []
    blame = StallBlame()
    stalls = _stalls(MAX_NEW + 10, t0=1000.0)
    stalls["time"] = 1000.0 + 0.1 * stalls.index  # all within one read's span
    blame.update(stalls, _fake(calls))
    assert len(calls) == 1 and len(calls[0]) == MAX_NEW
    assert set(calls[0]["step"]) == set(stalls["step"].iloc[-MAX_NEW:])  # the newest
    blame.update(stalls, _fake(calls))  # the rest
    assert len(calls) == 2 and len(calls[1]) == 10
    blame.update(stalls, _fake(calls))  # nothing new: no read
    assert len(calls) == 2 and blame.reads == 2
    row = next(stalls.itertuples())
    note = blame.note(row)
    assert "rag-1 (rag, 2,000 tokens): 350 ms" in note and "380 ms of it others" in note
    choices = stall_choices(stalls, blame)
    assert len(choices) == len(stalls)
    assert next(iter(choices.values())) == (stalls["request_id"].iloc[-1], "rag-1")
    assert len(stall_choices(stalls, blame, limit=5)) == 5  # the picker lists the newest only
    blame.update(stalls.head(3), _fake(calls))  # the window moved on: the rest forgotten
    assert len(blame.held) == 3 and len(calls) == 2


def test_a_failed_read_leaves_the_stalls_to_the_next_redraw() -> None:
    blame = StallBlame()
    stalls = _stalls(3)

    def broken(engine_id: str, run_id: str, tokens: pd.DataFrame) -> pd.DataFrame:
        raise RuntimeError("too few steps to fit")

    blame.update(stalls, broken)
    assert blame.error == "too few steps to fit" and not blame.held
    assert "being worked out" in blame.note(next(stalls.itertuples()))
    calls: list[pd.DataFrame] = []
    blame.update(stalls, _fake(calls))
    assert len(calls) == 1 and blame.error is None and len(blame.held) == 3


def test_a_stall_the_ledger_has_no_figure_for_says_so() -> None:
    blame = StallBlame()
    stalls = _stalls(2)

    def partial(engine_id: str, run_id: str, tokens: pd.DataFrame) -> pd.DataFrame:
        return _fake([])(engine_id, run_id, tokens[tokens["step"] == 100])

    blame.update(stalls, partial)
    rows = list(stalls.itertuples())
    assert "rag-1" in blame.note(rows[0])
    assert "no ledger for this gap" in blame.note(rows[1])
    assert len(stall_choices(stalls, blame)) == 1
