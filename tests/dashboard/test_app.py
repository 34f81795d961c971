"""Every page rendered by ``streamlit.testing.v1.AppTest`` against a store seeded through a real
collector, the empty-store and collector-down paths, and the control path."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from testkit.seed import SynthRun, send_run

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")
PAGES = ["views/live.py", "views/step.py", "views/requests.py", "views/control.py",
         "views/compare.py"]  # fmt: skip
TIMEOUT = 60


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A collector on a fresh SQLite store holding one synthetic run (a budget change from
    2048 to 128 at step 120); yields (collector URL, database URL)."""
    from testkit.collector import start_collector

    db_url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'chunkscope.db'}"
    collector = start_collector(db_url)
    try:
        other = SynthRun(engine_id="engine-other", run_id="run-other", change_at_step=None)
        other.num_steps = 60
        send_run(collector.url, other)
        run = SynthRun()  # sent last: the newest run, selected by default
        assert send_run(collector.url, run) == len(run.events()) + 1  # + goodbye
        yield collector.url, db_url
    finally:
        collector.stop()


def _app(monkeypatch: pytest.MonkeyPatch, collector_url: str, db_url: str) -> AppTest:
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
    return AppTest.from_file(APP, default_timeout=TIMEOUT)


def _texts(at: AppTest, kind: str) -> list[str]:
    return [str(e.value) for e in getattr(at, kind)]


def _shown(at: AppTest, kind: str) -> str:
    """The texts of ``kind`` as a reader sees them: an engine's text is escaped for Markdown
    (dashboard.text.as_text), so drop the escapes."""
    return " ".join(re.sub(r"\\(.)", r"\1", t).replace("\u00a0", " ") for t in _texts(at, kind))


def _charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_live_page_draws_every_chart_with_the_budget_change(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    assert not at.exception
    assert _texts(at, "header") == ["Live"]
    charts = _charts(at)
    titles = [c["layout"]["title"]["text"] for c in charts]
    assert titles[0] == "Tokens per step"
    assert titles[1].startswith("Inter-token latency — ") and "stalls" in titles[1]
    assert titles[2:] == ["KV cache and queue", "Latency by class"]
    # the budget change is a marker on every time axis (not on the latency bars)
    for c in charts[:3]:
        texts = [a.get("text") for a in c["layout"].get("annotations", [])]
        assert "budget 2048 → 128 @ step 120" in texts
        assert any(s["type"] == "line" for s in c["layout"]["shapes"])
    # stalls ringed: the 2,000-token prefill steps at budget 2048 stall the chat streams
    names = [t["name"] for t in charts[1]["data"]]
    assert "stall" in names and "chat" in names
    # the run ended with a goodbye: the page says the data is stored, not live
    assert any("disconnected" in c for c in _texts(at, "caption"))
    summary = at.dataframe[0].value
    assert set(summary["traffic_class"]) == {"chat", "rag", "all"}
    # one line says what the change did: the stalls either side, and the worst one's height
    line = next(m for m in _texts(at, "markdown") if "budget 2048 → 128 @ step 120" in m)
    assert "chat gaps across a long prefill, before: 8 in 1 s, the worst 255 ms" in line
    assert "the worst 20 ms" in line and "**the worst 13.0x shorter**" in line


def test_all_engines_shows_every_run(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    picker = at.sidebar.selectbox(key="engine_choice")
    assert picker.options[-1] == "All engines" and len(picker.options) == 3
    assert picker.value.startswith("engine-test · run-test-1")
    picker.set_value("All engines").run()
    assert not at.exception
    assert any(c.startswith("**All engines**") for c in _texts(at, "caption"))
    window = at.session_state["live_window"]
    assert set(window.steps["run_id"]) == {"run-test-1", "run-other"}
    for page in PAGES[1:]:
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)


def test_every_page_renders_the_seeded_store(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, *seeded).run()
    for page in PAGES[1:]:
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
    at.switch_page("views/step.py").run()
    assert at.number_input(key="step_number").value == 239
    layout = [c for c in _charts(at) if c["layout"]["title"]["text"].startswith("Chunk layout")]
    assert layout and {t["name"] for t in layout[0]["data"]} == {"decode"}
    at.number_input(key="step_number").set_value(130).run()
    chunks = at.dataframe[-1].value
    assert set(chunks["step"]) == {130}
    assert "prefill" in set(chunks["kind"])  # rag-2 arrives at step 130, prefilled in chunks

    at.switch_page("views/requests.py").run()
    table = at.dataframe[0].value
    assert len(table) == 13  # 4 long chat streams, 4 RAG prompts, 5 short chats
    assert (
        at.selectbox(key="request_pick").value
        == table.sort_values("max_itl_ms").iloc[-1]["request_id"]
    )
    assert [m.label for m in at.metric][:4] == ["TTFT", "TPOT", "max ITL", "end to end"]

    at.switch_page("views/compare.py").run()
    table = at.dataframe[0].value.set_index("metric")
    # the page leads with the stalls: each side of the change reaches to the run's edges and
    # holds two 2,000-token prompts; the worst chat gap across one goes from a whole-prompt
    # step (254 ms) to a 128-token chunk (20 ms)
    lead = _texts(at, "markdown")
    assert lead[0].startswith("**Stalls 13.0x shorter**: the worst chat gap across a long ")
    assert "from 255 ms to 20 ms" in lead[0]
    assert "Before (" in lead[1] and ": 2 long prompt(s)" in lead[1]
    assert "long prompts wait longer for their first token" in lead[2]
    metrics = {m.label: m for m in at.metric}
    assert metrics["Worst stall (ms)"].value == "20"
    assert metrics["Long prompts that stalled streams"].value == "2 → 2"
    # the stalled streams by default; the whole run either side of the change: the tail shrinks
    assert next(s for s in at.selectbox if s.label == "Traffic class").value == "chat"
    assert table.loc["ITL max (ms)", "B / A"] < 0.5
    assert table.loc["ITL max (ms)", "B vs A"] == "▲ better"
    assert table.loc["ITL max (ms)", "better"] == "lower"
    for mode in ("Two windows", "Two runs"):
        at.radio[0].set_value(mode).run()
        assert not at.exception, mode
        cols = ["metric", "A", "B", "B / A", "better", "B vs A"]
        assert list(at.dataframe[0].value.columns) == cols
    # two engines over the same window: each side is its own engine's traffic
    at.radio[0].set_value("Two engines").run()
    assert not at.exception
    assert at.selectbox(key="compare_engine_a").value == "engine-other"
    assert at.selectbox(key="compare_engine_b").value == "engine-test"
    table = at.dataframe[0].value.set_index("metric")
    from storage import queries
    from storage.db import connect

    store = connect(seeded[1])
    runs = queries.engines(store).drop_duplicates("engine_id").set_index("engine_id")
    end = float(runs.last_time.min())  # the earlier engine's last step: the shared window's end
    for side, engine in (("A", "engine-other"), ("B", "engine-test")):
        want = queries.latency_summary(
            store, engine_id=engine, run_id=runs.loc[engine, "run_id"], since=end - 300, until=end
        )
        shown = next(s for s in at.selectbox if s.label == "Traffic class").value  # chat here
        want = want[want.traffic_class == shown].iloc[0]
        assert table.loc["throughput (tokens/s)", side] == pytest.approx(want.tokens_per_s)
        assert table.loc["requests", side] == want.num_requests
    assert table.loc["throughput (tokens/s)", "A"] != table.loc["throughput (tokens/s)", "B"]
    assert any("Both engines over the same 300 s" in c for c in _texts(at, "caption"))
    # a run that went on after the shared window, or started inside it, is said to have
    from dashboard.ui import span_notes

    rows = [runs.loc[e].to_dict() | {"engine_id": e} for e in ("engine-other", "engine-test")]
    want_notes = span_notes(rows, end - 300, end)
    warned = [w for w in _texts(at, "warning") if "did not run over the same span" in w]
    assert len(warned) == (1 if want_notes else 0)
    assert span_notes([{"engine_id": "x", "started": 100.0, "last_time": 500.0}], 0, 400) == [
        "x started 100 s into the window",
        "x ran on until 500 (100 s after it)",
    ]
    assert span_notes([{"engine_id": "x", "started": 3.0, "last_time": 402.0}], 0, 400) == []
    at.selectbox(key="compare_engine_a").set_value("engine-test").run()
    table = at.dataframe[0].value.set_index("metric")
    assert len(table["B / A"].dropna()) > 3 and (table["B / A"].dropna() == 1.0).all()


def test_empty_store_and_collector_down_show_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage import db

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    db.migrate(db.connect(url))
    at = _app(monkeypatch, "ws://127.0.0.1:9", url).run()
    for page in PAGES:
        at.switch_page(page).run()
        assert not at.exception, (page, at.exception)
        infos = " ".join(_texts(at, "info"))
        assert "python -m engine" in infos or "nothing to control" in infos, page
    assert any("unreachable" in w for w in _texts(at, "warning"))


def test_store_not_created_yet_is_a_message_not_an_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    at = _app(monkeypatch, "ws://127.0.0.1:9", f"sqlite:///{tmp_path / 'nothing-yet.db'}").run()
    assert not at.exception
    assert any("cannot be read" in w or "cannot read" in w for w in _texts(at, "warning"))


def test_bad_settings_are_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", "ws://127.0.0.1:9")
    monkeypatch.delenv("CHUNKSCOPE_DB_URL", raising=False)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert "needs the store too" in _shown(at, "error")


@pytest.fixture(scope="module")
def live_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A real collector and a real ``tiny`` engine server publishing to it (free ports);
    yields (collector URL, database URL, engine HTTP URL) once the collector lists it."""
    from dashboard import control
    from dashboard.processes import ManagedProcess, python_argv
    from testkit.collector import start_collector
    from wire.ready import ENGINE_READY

    tmp = tmp_path_factory.mktemp("live")
    db_url = f"sqlite:///{tmp / 'chunkscope.db'}"
    collector = start_collector(db_url)
    engine = ManagedProcess(
        "engine",
        python_argv(
            "engine",
            "--model",
            "tiny",
            "--port",
            "0",
            "--token-budget",
            "512",
            "--max-token-budget",
            "4096",
            "--collector-url",
            collector.url,
        ),  # fmt: skip
        tmp / "engine.log",
    ).start()
    try:
        url = engine.wait_ready(ENGINE_READY, timeout=120)
        deadline = time.monotonic() + 60
        while not any(e.get("connected") for e in control.list_engines(collector.url)):
            assert time.monotonic() < deadline, engine.log_tail()
            time.sleep(0.2)
        yield collector.url, db_url, url
    finally:
        engine.stop()
        collector.stop()


def _engine_budget(engine_url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{engine_url}/v1/scheduler", timeout=10) as r:
        return int(json.loads(r.read())["token_budget"])


def test_control_page_changes_a_real_engine_through_the_collector(
    live_engine: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    collector_url, db_url, engine_url = live_engine
    at = _app(monkeypatch, collector_url, db_url).run()
    at.switch_page("views/control.py").run()
    assert not at.exception
    budget = at.number_input(key="budget_input")
    assert budget.label == "Token budget" and budget.value == 512
    apply = next(b for b in at.button if b.label == "Apply budget")

    budget.set_value(256)
    apply.click().run()
    ok = _shown(at, "success")
    assert re.search(r"applied at step \d+ \(token_budget 512 → 256\)", ok), ok
    assert _engine_budget(engine_url) == 256
    # the same page, drawn after the answer: the value in force and the change in History
    assert next(m for m in at.metric if m.label == "Token budget").value == "256"
    history = at.dataframe[0].value
    step = int(re.search(r"applied at step (\d+)", ok).group(1))  # type: ignore[union-attr]
    assert (history["applied_at_step"] == step).any(), history

    # refused in the UI, never sent: the engine keeps 256
    for bad, reason in ((0, "from 1 to 4096, got 0"), (10**6, "from 1 to 4096, got 1000000")):
        at.number_input(key="budget_input").set_value(bad)
        next(b for b in at.button if b.label == "Apply budget").click().run()
        assert f"Not sent: token budget must be {reason}" in _shown(at, "error")
        assert _engine_budget(engine_url) == 256

    # the policy through the same path, and the history shows the accepted change
    at.radio[0].set_value("unchunked")
    next(b for b in at.button if b.label == "Apply policy").click().run()
    assert "policy chunked → unchunked" in _shown(at, "success")
    # the history comes from the store: the engine's control events arrive a moment later
    deadline = time.monotonic() + 30
    while True:
        history = at.dataframe[-1].value if at.dataframe else None
        if (
            history is not None
            and "key" in history
            and {"token_budget", "policy"} <= set(history["key"])
        ):
            break
        assert time.monotonic() < deadline, history
        time.sleep(0.5)
        at.run()
    assert history[history["key"] == "token_budget"]["accepted"].astype(bool).all()


def test_control_page_with_the_collector_down_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage import db

    url = f"sqlite:///{tmp_path / 'store.db'}"
    db.migrate(db.connect(url))
    at = _app(monkeypatch, "ws://127.0.0.1:9", url).run()
    at.switch_page("views/control.py").run()
    assert not at.exception
    assert any("control needs it" in w for w in _texts(at, "warning"))
    assert not [b for b in at.button if b.label == "Apply budget"]


def test_collector_down_then_back_keeps_stored_data_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from testkit.collector import start_collector
    from tests.dashboard.server import free_port

    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    port = free_port()
    collector = start_collector(db_url, args=["--port", str(port)])
    try:
        send_run(collector.url, SynthRun())
        at = _app(monkeypatch, collector.url, db_url).run()
        assert any("Collector up" in t for t in _texts(at, "success"))
    finally:
        collector.stop()
    time.sleep(2.5)  # the collector's state is cached for 2 s
    at.run()
    assert not at.exception
    assert any("unreachable" in w for w in _texts(at, "warning"))
    assert _charts(at)[0]["layout"]["title"]["text"] == "Tokens per step"  # stored data still drawn
    assert at.session_state["live_window"].steps["step"].max() == 239

    collector = start_collector(db_url, args=["--port", str(port)])
    try:
        time.sleep(2.5)
        at.run()
        assert any("Collector up" in t for t in _texts(at, "success"))
        assert not any("unreachable" in w for w in _texts(at, "warning"))
    finally:
        collector.stop()


def test_the_control_page_shows_an_engine_refusal_as_text(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from markdown_it import MarkdownIt

    at = _app(monkeypatch, *seeded).run()
    at.switch_page("views/control.py")
    refusal = "Engine e: refused: **budget** [click](http://evil.example)"
    at.session_state["control_answer"] = ("refused", refusal)
    at.run()
    assert not at.exception
    (shown,) = [e for e in _texts(at, "error") if "refused" in e]
    html = MarkdownIt("commonmark").render(shown)
    assert "<strong>" not in html and "<a " not in html
    assert "**budget** [click](http://evil.example)" in html


def test_the_sidebar_shows_the_store_size(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from storage import db as dbm
    from storage.retention import human_bytes, store_size

    at = _app(monkeypatch, *seeded).run()
    assert not at.exception
    [line] = [c for c in _texts(at, "caption") if c.startswith("Store size:")]
    used = store_size(dbm.connect(seeded[1], readonly=True)).used_bytes
    assert human_bytes(used) in line and "chunkscope prune" in line


def test_a_run_without_steps_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that said hello and has not stepped yet (the dashboard's first seconds): the
    status line says so instead of a Python ``None``."""
    from testkit.collector import start_collector

    db_url = f"sqlite:///{tmp_path / 'nosteps.db'}"
    collector = start_collector(db_url)
    try:
        run = SynthRun(engine_id="engine-new", run_id="run-new", change_at_step=None)
        run.num_steps = 0
        send_run(collector.url, run)
        at = _app(monkeypatch, collector.url, db_url).run()
    finally:
        collector.stop()
    assert not at.exception
    status = next(t for t in _texts(at, "caption") if "engine-new" in t)
    assert "no steps yet" in status and "None" not in status


def test_the_traffic_fields_take_the_profiles_preset_and_keep_a_typed_value(
    seeded: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each profile has its own rate and chat-users fields, drawn with its preset; a value typed
    is kept through redraws. The fields are the profile's own (their keys name it): a value the
    browser still holds for another profile's field can never overwrite this one's."""
    from dashboard.services import PROFILES

    at = _app(monkeypatch, *seeded).run()
    assert not at.exception
    first = at.sidebar.selectbox(key="traffic_profile").value
    rate = at.sidebar.number_input(key=f"traffic_rate_{first}")
    users = at.sidebar.number_input(key=f"traffic_users_{first}")
    assert (rate.value, users.value) == (PROFILES[first].rate, PROFILES[first].users)
    at.sidebar.selectbox(key="traffic_profile").set_value("vlm").run()
    assert at.sidebar.number_input(key="traffic_rate_vlm").value == PROFILES["vlm"].rate
    assert at.sidebar.number_input(key="traffic_users_vlm").value == PROFILES["vlm"].users
    at.sidebar.number_input(key="traffic_users_vlm").set_value(PROFILES["vlm"].users + 7).run()
    at.run()  # a redraw keeps what was typed
    assert at.sidebar.number_input(key="traffic_users_vlm").value == PROFILES["vlm"].users + 7
    at.sidebar.selectbox(key="traffic_profile").set_value("rag").run()
    assert at.sidebar.number_input(key="traffic_users_rag").value == PROFILES["rag"].users
    assert at.sidebar.number_input(key="traffic_rate_rag").value == PROFILES["rag"].rate
    # back to vlm after full runs that did not draw its fields: what was typed is still there
    at.run()
    at.sidebar.selectbox(key="traffic_profile").set_value("vlm").run()
    assert at.sidebar.number_input(key="traffic_users_vlm").value == PROFILES["vlm"].users + 7
    assert at.sidebar.number_input(key="traffic_rate_vlm").value == PROFILES["vlm"].rate
