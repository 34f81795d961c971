"""The Fleet page (AppTest): every engine of a store seeded through a real collector, worst
first as ``storage.fleet_summary`` orders them, and one click opening an engine's Live page with
that engine selected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from storage.db import connect
from storage.fleet_summary import fleet_summary
from testkit.seed import SynthRun, send_run

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")
TIMEOUT = 60


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two engines on one collector: one that stalls its chat streams (budget 2048, then 128),
    one that never changes its budget."""
    from testkit.collector import start_collector

    db_url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'chunkscope.db'}"
    collector = start_collector(db_url)
    try:
        other = SynthRun(engine_id="engine-calm", run_id="run-calm", change_at_step=None)
        other.num_steps = 60
        send_run(collector.url, other)
        send_run(collector.url, SynthRun())
        yield collector.url, db_url
    finally:
        collector.stop()


def test_fleet_lists_every_engine_worst_first_and_opens_one(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    collector_url, db_url = seeded
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page("views/fleet.py").run()
    assert not at.exception, at.exception
    assert [h.value for h in at.header] == ["Fleet"]
    want = fleet_summary(connect(db_url, readonly=True))
    table = at.dataframe[0].value
    assert list(table["engine"]) == list(want["engine_id"])
    assert set(table["engine"]) == {"engine-test", "engine-calm"}
    worst = want.iloc[0]
    assert worst["engine_id"] == "engine-test"  # its 2,000-token prompts stall chat streams
    assert worst["stalls"] > 0 and worst["worst_chat_itl_ms"] > 200
    assert (want["steps_per_s"] > 0).all()
    # one click: the engine's Live page, with that engine selected in the sidebar
    at.button(key="fleet-open-engine-calm").click().run()
    assert not at.exception, at.exception
    assert [h.value for h in at.header] == ["Live"]
    assert str(at.session_state["engine_choice"]).startswith("engine-calm · ")
