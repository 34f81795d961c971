"""The Control page for an engine that honours fewer controls (the vLLM bridge's hello says
``policies: ["chunked"]``, ``engine_kind: "vllm"``): the budget control only, no policy switch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from testkit.collector import start_collector
from testkit.engines import FakeEngineClient, SyntheticEngine

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")


def test_control_page_offers_only_what_a_vllm_engine_supports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db_url = f"sqlite:///{tmp_path / 'chunkscope.db'}"
    collector = start_collector(db_url)
    eng = SyntheticEngine(engine_id="vllm-a", run_id="run-vllm", max_token_budget=2048)
    base = eng.hello

    def hello(token: str | None = None) -> dict[str, Any]:
        return {**base(token), "policies": ["chunked"], "engine_kind": "vllm"}

    eng.hello = hello  # type: ignore[method-assign]
    client = FakeEngineClient(collector.url, eng)
    try:
        client.connect()
        client.send_events(eng.steps(5))
        from storage.control import list_engines

        listed = list_engines(collector.url)
        assert listed[0]["connected"] and listed[0]["policies"] == ["chunked"]
        assert listed[0]["engine_kind"] == "vllm"
        monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector.url)
        monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
        monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
        at = AppTest.from_file(APP, default_timeout=60).run()
        at.switch_page("views/control.py").run()
        assert not at.exception
        assert not at.radio  # no policy switch
        assert not [b for b in at.button if b.label == "Apply policy"]
        captions = " ".join(str(c.value) for c in at.caption)
        assert "Policy: chunked, fixed (vllm cannot change it while it runs)" in captions
        assert [b for b in at.button if b.label == "Apply budget"]
    finally:
        client.close()
        collector.stop()
