"""The blame ledger on the pages: the Requests page shows a stalled chat stream's gaps with the
long prompt that caused them and the window's top offenders; Compare says which class caused
the stall time on each side of the budget change. AppTest against a store seeded through a
real collector (the scripted stall story: four chat streams, a 2,000-token RAG prompt at
steps 10, 60, 130 and 180)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import blame_charts
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


def test_requests_page_names_the_culprit_of_each_stall(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    at.switch_page("views/requests.py").run()
    assert not at.exception
    # the worst stall first: a long chat stream, stalled by the whole-prompt prefills
    rid = at.selectbox(key="request_pick").value
    assert rid.startswith("chat-")
    assert [m.label for m in at.metric][4:] == ["Excess", "Of it, queued", "Stalls", "Top culprit"]
    charts = {json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec)
              for c in at.get("plotly_chart")}  # fmt: skip
    timeline = charts["Who slowed it: each gap split"]
    assert [t["name"] for t in timeline["data"]] == ["own work", "pauses", "excess (others)"]
    labels = {a["text"] for a in timeline["layout"]["annotations"]}
    assert labels and labels <= {"rag-0", "rag-1", "rag-2", "rag-3"}
    culprits = at.dataframe[1].value  # after the requests table
    assert culprits["request_id"].iloc[0].startswith("rag-")
    assert list(culprits["ms"]) == sorted(culprits["ms"], reverse=True)
    offenders = at.dataframe[2].value
    assert list(offenders.columns) == blame_charts.OFFENDER_COLUMNS
    # the long prompts lead the offenders, with their class and prompt length
    top4 = offenders.head(4)
    assert set(top4["request_id"]) == {"rag-0", "rag-1", "rag-2", "rag-3"}
    assert set(top4["traffic_class"]) == {"rag"} and set(top4["num_prompt_tokens"]) == {2000}
    assert any("caused by rag" in str(c.value) for c in at.caption)
    # the simulator's counterfactual for the top culprit, beside the ledger's blame
    at.button(key="replay_without").click().run()
    assert not at.exception
    line = next(
        str(m.value) for m in at.markdown if "Replayed through the scheduler" in str(m.value)
    )
    assert "sooner (predicted); the ledger blamed" in line


def test_compare_page_says_which_class_caused_the_stalls(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    at.switch_page("views/compare.py").run()
    assert not at.exception
    assert "Who caused the stalls" in [str(h.value) for h in at.subheader]
    lines = [str(m.value) for m in at.markdown if str(m.value).startswith("- ")]
    assert len(lines) == 2 and all("caused by rag" in line for line in lines)
    fig = next(
        json.loads(c.proto.spec)
        for c in at.get("plotly_chart")
        if json.loads(c.proto.spec)["layout"]["title"]["text"].startswith("Stall time caused")
    )
    assert len(fig["data"]) == 2 and all("rag" in t["x"] for t in fig["data"])


def test_figures_without_data_say_so() -> None:
    empty = blame_charts.stall_timeline_figure(pd.DataFrame())
    assert "no gaps" in empty.layout.annotations[0].text
    fig = blame_charts.class_cost_figure({})
    assert "no request slowed another" in fig.layout.annotations[0].text
    assert blame_charts.class_cost_line(pd.DataFrame()) == "nobody slowed anybody"
    by_class = pd.DataFrame({"traffic_class": ["rag", "chat"], "ms": [800.0, 200.0],
                             "share": [0.8, 0.2]})  # fmt: skip
    assert blame_charts.class_cost_line(by_class) == "rag 80%, chat 20%"
    fig = blame_charts.class_cost_figure({"A": by_class})
    assert list(fig.data[0].y) == [0.8, 0.2]
    assert blame_charts.offenders_frame([]).columns.tolist() == blame_charts.OFFENDER_COLUMNS
