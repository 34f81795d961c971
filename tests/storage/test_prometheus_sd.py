"""Debian's ``prometheus`` finds a small fleet through a collector's ``GET /sd`` (two collectors
on one PostgreSQL store, an engine on each), scrapes it, and every PromQL query of the shipped
Grafana dashboard (deploy/grafana/chunkscope-fleet.json) returns data.

The engines are synthetic (``testkit.engines.SyntheticEngine``'s steps, in real time) with the
engine's own Prometheus metrics (``engine.server.metrics.EngineMetrics``) on an HTTP port and
the engine's publisher. Skipped without ``prometheus`` on the PATH, unless
CHUNKSCOPE_REQUIRE_PROMETHEUS=1 (CI), which makes it fail instead."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from engine.server.metrics import EngineMetrics
from engine.telemetry import Publisher
from engine.telemetry.metrics import register_metrics
from testkit.engines import SyntheticEngine
from testkit.postgres import PostgresServer
from wire.events import event_from_dict

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "chunkscope-fleet.json"
WAIT_S = 40.0

pytestmark = pytest.mark.slow


def _prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        reason = "no prometheus on the PATH (apt-get install prometheus)"
        if os.environ.get("CHUNKSCOPE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MetricsEngine:
    """A synthetic engine stepping in real time: its events feed the engine's Prometheus
    metrics (served at ``metrics_url``) and its publisher (to ``collector_url``)."""

    def __init__(self, engine_id: str, collector_url: str, seed: int) -> None:
        self.syn = SyntheticEngine(engine_id=engine_id, run_id=f"run-{engine_id}", seed=seed)
        self.metrics = EngineMetrics("synthetic", engine_id)
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body, ctype = metrics.render()
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.metrics_url = f"http://127.0.0.1:{self.http.server_address[1]}/metrics"
        fields = {k: v for k, v in self.syn.hello().items() if k not in ("engine_id", "run_id")}
        fields["metrics_url"] = self.metrics_url
        self.publisher = Publisher(
            collector_url,
            engine_id=engine_id,
            run_id=self.syn.run_id,
            hello=lambda: fields,
            linger_s=0.02,
        )
        # the publisher's own counters on the same /metrics, as the engine server has them
        register_metrics(
            self.publisher, self.metrics.registry, model_name="synthetic", engine_id=engine_id
        )
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self.http.serve_forever, daemon=True),
            threading.Thread(target=self._step, daemon=True),
        ]

    def start(self) -> MetricsEngine:
        self.publisher.start()
        for t in self._threads:
            t.start()
        return self

    def _step(self) -> None:
        while not self._stop.wait(0.02):
            for ev in self.syn.steps(1):
                self.metrics.on_event(event_from_dict(ev))
                self.publisher.publish({k: v for k, v in ev.items() if k != "seq"})

    def stop(self) -> None:
        self._stop.set()
        self.publisher.close(timeout=5)
        self.http.shutdown()
        self.http.server_close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """``start(sd_url)`` -> the base URL of a prometheus discovering ``sd_url``."""
    binary = _prometheus()
    procs: list[subprocess.Popen[bytes]] = []

    def start(sd_url: str) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: chunkscope\n"
            "    http_sd_configs:\n"
            f"      - url: {sd_url}\n"
            "        refresh_interval: 1s\n"
        )
        port = _free_port()
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait(cond: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = cond()
        except OSError as exc:  # prometheus still starting
            last = exc
        else:
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {str(last)[:1000]}")


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def test_prometheus_finds_the_fleet_and_every_dashboard_query_has_data(
    pg_server: PostgresServer,
    collector_factory: Callable[..., Any],
    prometheus: Callable[[str], str],
) -> None:
    queries = _queries()
    assert len(queries) >= 10
    db_url = pg_server.create_database()
    a = collector_factory(db_url)
    b = collector_factory(db_url)
    engines = [
        MetricsEngine("eng-p1", a.url, seed=1).start(),
        MetricsEngine("eng-p2", b.url, seed=2).start(),
    ]
    try:
        base = prometheus(f"http://127.0.0.1:{a.port}/sd")

        def all_up() -> bool:
            targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
            up = {
                t["labels"].get("engine_id") or t["labels"]["collector"]: t["health"]
                for t in targets
            }
            want = {"eng-p1", "eng-p2", a.url, b.url}
            return set(up) == want and all(h == "up" for h in up.values())

        _wait(all_up, "prometheus to discover and scrape two engines and two collectors")

        def has_data(expr: str) -> Callable[[], list[Any]]:
            def query() -> list[Any]:
                url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                result = _get(url)["data"]["result"]
                return [r for r in result if r["value"][1] not in ("NaN", "+Inf", "-Inf")]

            return query

        for expr in queries:
            _wait(has_data(expr), f"data for {expr}")
        engines_up = _get(
            f"{base}/api/v1/query?"
            + urllib.parse.urlencode({"query": 'up{chunkscope_role="engine"}'})
        )["data"]["result"]
        by_engine = {r["metric"]["engine_id"]: r["metric"]["collector"] for r in engines_up}
        assert by_engine == {"eng-p1": a.url, "eng-p2": b.url}
    finally:
        for eng in engines:
            eng.stop()
