"""The collector's health and Prometheus metrics: its own registry, and the answers to
``GET /healthz`` and ``GET /metrics``."""

from __future__ import annotations

from http import HTTPStatus

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Response


class Metrics:
    """The collector's own Prometheus registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.frames = Counter("collector_frames", "Frames received on /ingest", registry=r)
        self.events = Counter("collector_events", "Events stored, by type", ["type"], registry=r)
        self.duplicates = Counter(
            "collector_duplicate_events", "Resent events already stored (skipped)", registry=r
        )
        self.refusals = Counter(
            "collector_refusals",
            "Frames, events or controls refused, by reason",
            ["reason"],
            registry=r,
        )
        self.ingest_lag = Gauge(
            "collector_ingest_lag_seconds",
            "Receipt of a frame to its commit, for the latest batch (oldest frame in it)",
            registry=r,
        )
        self.ingest_lag_hist = Histogram(
            "collector_ingest_lag_hist_seconds",
            "Receipt of a frame to its commit",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.batch_seconds = Histogram(
            "collector_write_batch_seconds",
            "Time to write and commit one batch",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.batch_events = Histogram(
            "collector_write_batch_events",
            "Events per committed batch",
            registry=r,
            buckets=(1, 10, 100, 1000, 5000, 20000, 50000),
        )
        self.pending = Gauge(
            "collector_pending_events", "Events received but not yet committed", registry=r
        )
        self.pending_bytes = Gauge(
            "collector_pending_bytes",
            "Bytes of frames received but not yet committed (bounded by --max-pending-bytes)",
            registry=r,
        )
        self.connected = Gauge(
            "collector_connected_engines", "Engines connected on /ingest", registry=r
        )
        self.control_clients = Gauge(
            "collector_control_clients", "Clients connected on /control", registry=r
        )
        self.controls = Counter(
            "collector_controls", "Controls relayed, by outcome", ["outcome"], registry=r
        )
        self.store_size = Gauge(
            "collector_store_size_bytes",
            "Store size the retention limits count (SQLite: pages in use; PostgreSQL: the "
            "tables' total relation size), measured every retention interval",
            registry=r,
        )
        self.store_file_size = Gauge(
            "collector_store_file_size_bytes",
            "Store size on disk (SQLite: database file and WAL; PostgreSQL: as store_size)",
            registry=r,
        )
        self.pruned_rows = Counter(
            "collector_pruned_rows", "Rows deleted by the retention limits", registry=r
        )
        self.pruned_runs = Counter(
            "collector_pruned_runs", "Whole runs deleted by the retention limits", registry=r
        )

    def refuse(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()


def health_response(connection: ServerConnection, problem: str) -> Response:
    """``GET /healthz``: 200, or 503 naming the store's ``problem``."""
    if problem:
        return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"store: {problem}\n")
    return connection.respond(HTTPStatus.OK, "ok\n")


def metrics_response(connection: ServerConnection, registry: CollectorRegistry) -> Response:
    """``GET /metrics``: the registry in Prometheus' text format."""
    response = connection.respond(HTTPStatus.OK, "")
    body = generate_latest(registry)
    response.body = body
    del response.headers["Content-Type"]
    del response.headers["Content-Length"]
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    response.headers["Content-Length"] = str(len(body))
    return response
