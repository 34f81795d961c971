"""A store outage shows on the dashboard: the collector's ``/healthz`` answers 503 naming the
store's problem, and the sidebar and the Live page say so in a banner; a healthy collector, or
none answering, shows none."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import health
from storage import db as dbm

APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "streamlit_app.py")
OUTAGE = "store: a batch has waited on the store for 4.2 s (database is locked)"


class _FakeCollector(BaseHTTPRequestHandler):
    """Answers ``/healthz`` as the collector does, with the server's ``status`` and ``body``."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server = self.server
        status, body = (server.status, server.body) if self.path == "/healthz" else (404, "")  # type: ignore[attr-defined]
        data = (body + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def fake_collector() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCollector)
    server.status, server.body = 503, OUTAGE  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"ws://127.0.0.1:{server.server_address[1]}"


def test_the_health_check_reads_the_collectors_answer(fake_collector: ThreadingHTTPServer) -> None:
    assert health.health_url("ws://127.0.0.1:8765") == "http://127.0.0.1:8765/healthz"
    assert health.health_url("wss://h:1/ingest") == "https://h:1/healthz"
    down = health.check(_url(fake_collector))
    assert down.store_outage and down.detail == OUTAGE
    fake_collector.status, fake_collector.body = 200, "ok"  # type: ignore[attr-defined]
    assert health.check(_url(fake_collector)) == health.CollectorHealth(True, "ok")
    port = fake_collector.server_address[1]
    fake_collector.shutdown()
    fake_collector.server_close()
    gone = health.check(f"ws://127.0.0.1:{port}", timeout=1.0)
    assert gone.ok is None and not gone.store_outage  # no answer is not an outage
    assert health.check("not a url").ok is None


def _app(monkeypatch: pytest.MonkeyPatch, collector_url: str, tmp_path: Path) -> AppTest:
    db_url = f"sqlite:///{tmp_path / 'store.db'}"
    db = dbm.connect(db_url)
    dbm.migrate(db)
    db.dispose()
    monkeypatch.setenv("CHUNKSCOPE_COLLECTOR_URL", collector_url)
    monkeypatch.setenv("CHUNKSCOPE_DB_URL", db_url)
    monkeypatch.delenv("CHUNKSCOPE_CONTROL_TOKEN", raising=False)
    return AppTest.from_file(APP, default_timeout=60)


def _errors(at: AppTest) -> list[str]:
    return [str(e.value) for e in at.error]


def test_a_store_outage_shows_on_the_sidebar_and_the_live_page(
    fake_collector: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    at = _app(monkeypatch, _url(fake_collector), tmp_path).run()
    assert not at.exception
    banners = [e for e in _errors(at) if e.startswith("Store outage")]
    assert len(banners) == 2, _errors(at)  # the sidebar's and the Live page's
    assert all("database is locked" in b and "resend" in b for b in banners)
    assert any("Store outage" in str(e.value) for e in at.sidebar.error)


def test_a_healthy_collector_shows_no_banner(
    fake_collector: ThreadingHTTPServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_collector.status, fake_collector.body = 200, "ok"  # type: ignore[attr-defined]
    at = _app(monkeypatch, _url(fake_collector), tmp_path).run()
    assert not at.exception
    assert not [e for e in _errors(at) if "Store outage" in e]
