"""The Sweep page (``streamlit.testing.v1.AppTest``) on a fixed sweep document, against a real
collector and a real ``tiny`` engine: the Pareto chart (measured and predicted, SLO line,
recommendation), the recommendation's reason, the table, and the button that applies the
recommended budget to the engine through the collector."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")
TIMEOUT = 60


def w(budget: int, itl: float, ttft: float, tps: float, **pred: float) -> dict:
    d = {"budget": budget, "itl_p50_ms": itl / 3, "itl_p99_ms": itl, "itl_max_ms": itl * 4,
         "ttft_p50_ms": ttft / 2, "ttft_p99_ms": ttft, "tokens_per_s": tps}  # fmt: skip
    d.update({f"predicted_{k}": v for k, v in pred.items()})
    return d


SWEEP = {
    "tool": "chunkscope-loadgen-sweep",
    "slo": {"itl_p99_ms": 100.0, "ttft_p99_ms": None},
    "windows": [
        w(128, 40.0, 2000.0, 90.0, itl_p99_ms=42.0, ttft_p99_ms=1800.0, tokens_per_s=91.0),
        w(256, 60.0, 1200.0, 100.0, itl_p99_ms=55.0, ttft_p99_ms=1300.0, tokens_per_s=99.0),
        w(1024, 230.0, 700.0, 121.0, itl_p99_ms=250.0, ttft_p99_ms=650.0, tokens_per_s=120.0),
    ],
    "recommended_budget": 256,
    "recommendation_source": "measured",
}


@pytest.fixture(scope="module")
def live_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A real collector and a real ``tiny`` engine server publishing to it (free ports)."""
    from dashboard import control
    from dashboard.processes import ManagedProcess, python_argv
    from testkit.collector import start_collector
    from wire.ready import ENGINE_READY

    tmp = tmp_path_factory.mktemp("live")
    db_url = f"sqlite:///{tmp / 'chunkscope.db'}"
    collector = start_collector(db_url)
    engine = ManagedProcess(
        "engine",
        python_argv("engine", "--model", "tiny", "--port", "0", "--token-budget", "512",
                    "--max-token-budget", "4096", "--collector-url", collector.url),
        tmp / "engine.log",
    ).start()  # fmt: skip
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


def _budget(engine_url: str) -> int:
    with urllib.request.urlopen(f"{engine_url}/v1/scheduler", timeout=10) as r:
        return int(json.loads(r.read())["token_budget"])


def test_sweep_page_draws_recommends_and_applies(
    live_engine: tuple[str, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector_url, db_url, engine_url = live_engine
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "demo-sweep.json").write_text(json.dumps(SWEEP))
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.setenv("CHUNKSCOPE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page("views/sweep.py").run()
    assert not at.exception
    assert [h.value for h in at.header] == ["Sweep"]
    assert at.selectbox(key="sweep_file").value == "demo-sweep.json"
    assert at.number_input(key="sweep_slo_itl").value == 100.0
    success = " ".join(str(s.value) for s in at.success)
    assert "Recommended token budget: **256**" in success and "measured" in success
    (chart,) = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    names = [t["name"] for t in chart["data"]]
    assert names == ["measured", "predicted", "recommended: 256"]
    assert chart["data"][0]["text"] == ["128", "256", "1024"]
    assert any(s.get("y0") == 100.0 for s in chart["layout"]["shapes"])  # the ITL SLO line
    table = at.dataframe[0].value
    assert list(table["budget"]) == [128, 256, 1024] and "predicted itl_p99_ms" in table

    # a tighter SLO: nothing meets it, the closest is named and offered
    at.number_input(key="sweep_slo_itl").set_value(30.0).run()
    assert "no budget meets ITL p99 <= 30 ms" in " ".join(str(x.value) for x in at.warning)

    at.number_input(key="sweep_slo_itl").set_value(100.0).run()
    apply = next(b for b in at.button if b.label.startswith("Apply budget 256"))
    apply.click().run()
    assert not at.exception
    ok = re.sub(r"\\(.)", r"\1", " ".join(str(s.value) for s in at.success))  # as_text escapes
    assert re.search(r"applied at step \d+ \(token_budget 512 → 256\)", ok), ok
    assert _budget(engine_url) == 256


def test_sweep_page_stall_slo_and_overloaded_windows(
    live_engine: tuple[str, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector_url, db_url, _ = live_engine
    windows = [
        # 128 meets every SLO but its queue grew through the window: never recommended
        {**w(128, 20.0, 900.0, 100.0), "overloaded": True,
         "overload_reason": "its queue grew from 0 to 30 requests waiting for a first token"},
        {**w(512, 30.0, 700.0, 100.0), "itl_max_ms": 240.0},
        {**w(4096, 16.0, 500.0, 100.5), "itl_max_ms": 1572.0},
    ]  # fmt: skip
    doc = {"tool": "chunkscope-loadgen-sweep", "slo": {"itl_p99_ms": 50.0}, "windows": windows}
    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "stall.json").write_text(json.dumps(doc))
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.setenv("CHUNKSCOPE_DATA_DIR", str(tmp_path))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.switch_page("views/sweep.py").run()
    assert not at.exception
    errors = " ".join(str(e.value) for e in at.error)
    assert "Measured: overloaded (not recommended): budget 128: its queue grew" in errors
    # a throughput tie between 512 and 4096: the lower stall tail wins
    success = " ".join(str(s.value) for s in at.success)
    assert "Recommended token budget: **512**" in success, success
    table = at.dataframe[0].value
    assert list(table["overloaded"]) == [True, False, False]
    # an SLO on the stall: 4096 (1.5 s stall) fails it, 512 still meets it
    at.number_input(key="sweep_slo_itl_max").set_value(200.0).run()
    warning = " ".join(str(x.value) for x in at.warning)
    assert "no budget meets ITL p99 <= 50 ms and ITL max <= 200 ms" in warning
    assert "closest is budget 512" in warning
