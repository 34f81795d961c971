"""Prometheus view of a publisher: read from its counters at scrape time (no hot-path cost)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from engine.telemetry.publisher import Publisher

PREFIX = "chunkscope_telemetry_"


class PublisherCollector(Collector):
    """``chunkscope_telemetry_*``: events published, dropped, spilled, queued; the acked seq;
    whether the collector is connected; reconnects. Labelled by model and engine."""

    def __init__(self, publisher: Publisher, model_name: str, engine_id: str) -> None:
        self.publisher = publisher
        self.labels = {"model_name": model_name, "engine_id": engine_id}

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.publisher.stats()
        names, values = list(self.labels), list(self.labels.values())
        counters = (
            ("events_published", "Events given to the publisher (dropped ones included).",
             s.published),
            ("events_dropped", "Events lost because the memory and spill limits were full "
             "(each loss is declared to the collector in a gap event).", s.dropped_total),
            ("events_spilled", "Events written to a spill file while memory was full.",
             s.spilled_total),
            ("gaps", "Gap events sent to declare lost events.", s.gaps_total),
            ("events_sent", "Events sent to the collector, resends included.", s.events_sent),
            ("frames_sent", "Event frames sent to the collector.", s.frames_sent),
            ("reconnects", "Connections to the collector after the first.", s.reconnects),
            ("connect_failures", "Failed attempts to reach the collector.", s.connect_failures),
            ("controls", "Controls relayed by the collector.", s.controls),
        )  # fmt: skip
        gauges = (
            ("events_queued", "Events held until the collector acknowledges them.", s.queued),
            ("spill_bytes", "Bytes of spill files held.", s.spill_bytes),
            ("acked_seq", "Highest seq the collector acknowledged as durable.", s.acked_seq),
            ("last_seq", "Highest seq assigned.", s.last_seq),
            ("connected", "1 while connected to the collector.", int(s.connected)),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(values, value)
            yield c
        for name, doc, value in gauges:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(values, value)
            yield g


def register_metrics(
    publisher: Publisher, registry: CollectorRegistry, *, model_name: str, engine_id: str
) -> PublisherCollector:
    collector = PublisherCollector(publisher, model_name, engine_id)
    registry.register(collector)
    return collector
