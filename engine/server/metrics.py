"""Prometheus metrics with vLLM's meanings, names prefixed ``chunkscope:``.

:class:`EngineMetrics` owns its own ``CollectorRegistry`` (one per server, so tests can run many)
and is fed from the engine's listener (``StepEvent`` / ``RequestEvent`` / ``ControlEvent``); the
gauges are refreshed from ``engine.stats()`` at scrape time so they are current even when the
engine is idle. Event times are monotonic nanoseconds; every latency is a difference of two of
them, in seconds. The engine emits events in causal order (a request's ``arrived`` before the
step that gives its first token), which the token counting here relies on. Unlike vLLM's
``iteration_tokens_total``, ``chunkscope:tokens_per_step`` counts every step, prefill-only chunks
included.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from wire.events import ControlEvent, RequestEvent, StepEvent

logger = logging.getLogger(__name__)

PREFIX = "chunkscope:"
DEFAULT_TRAFFIC_CLASS = "default"
# A label value is a time series per metric: the first MAX_TRAFFIC_CLASS_LABELS classes seen get
# their own, later ones are counted under OTHER_TRAFFIC_CLASS (the telemetry keeps the real one).
MAX_TRAFFIC_CLASS_LABELS = 32
OTHER_TRAFFIC_CLASS = "other"

# vLLM's buckets; the latency-per-token ones gain sub-10 ms buckets for fast GPUs.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TOKENS_PER_STEP_BUCKETS = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
)  # fmt: skip


@dataclass
class _Track:
    arrival_ns: int
    traffic_class: str
    first_token_ns: int | None = None
    last_token_ns: int | None = None


def _seconds(t0_ns: int, t1_ns: int) -> float:
    return max(0, t1_ns - t0_ns) / 1e9


class EngineMetrics:
    """The ``chunkscope:*`` metric family set for one engine."""

    def __init__(
        self, model_name: str, engine_id: str, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.engine_id = engine_id
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._classes: set[str] = set()  # traffic classes with a label of their own
        base = ("model_name", "engine_id")
        lat = (*base, "traffic_class")
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Time from arrival to the first output token, in seconds.",
            TTFT_BUCKETS,
            lat,
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive output tokens of a request, in seconds.",
            TOKEN_LATENCY_BUCKETS,
            lat,
        )
        self.tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            TOKEN_LATENCY_BUCKETS,
            lat,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Time from arrival to finish (or abort), in seconds.",
            REQUEST_LATENCY_BUCKETS,
            lat,
        )
        self.queue_time = hist(
            "request_queue_time_seconds",
            "Time from arrival to first being scheduled, in seconds.",
            REQUEST_LATENCY_BUCKETS,
            lat,
        )
        self.tokens_per_step = hist(
            "tokens_per_step",
            "Tokens scheduled per engine step (every step, prefill-only chunks included).",
            TOKENS_PER_STEP_BUCKETS,
            base,
        )
        g = {"labelnames": base, "registry": r}
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the running set.", **g)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to run.", **g)
        self.kv_usage = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).", **g
        )
        self.kv_used = Gauge(PREFIX + "kv_cache_blocks_used", "KV cache blocks in use.", **g)
        self.budget = Gauge(PREFIX + "token_budget", "Token budget in force for a step.", **g)
        self.long_prefill = Gauge(
            PREFIX + "long_prefill_token_threshold",
            "Most prefill tokens one request may take in a step while other prompts wait "
            "(0: no cap).",
            **g,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of requests that produced a token.", **g
        )
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens.", **g)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Preempted requests.", **g)
        self.steps = Counter(PREFIX + "steps", "Engine steps that scheduled tokens.", **g)
        self.requests_finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            (*base, "finished_reason"),
            registry=r,
        )
        self._labels = {"model_name": model_name, "engine_id": engine_id}
        for metric in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.steps):
            metric.labels(**self._labels)  # expose zeros before the first request

    # --- feeding ------------------------------------------------------------------------------
    def on_event(self, event: object) -> None:
        """Engine listener: never raises (a metrics bug must not stop the step loop)."""
        try:
            if isinstance(event, StepEvent):
                self._on_step(event)
            elif isinstance(event, RequestEvent):
                self._on_request(event)
            elif isinstance(event, ControlEvent):
                if event.accepted and event.key == "token_budget":
                    self.budget.labels(**self._labels).set(event.new_value)
                elif event.accepted and event.key == "long_prefill_token_threshold":
                    self.long_prefill.labels(**self._labels).set(event.new_value)
        except Exception:
            logger.exception("metrics: failed to record %s", type(event).__name__)

    def _lat(self, tc: str) -> dict[str, str]:
        return {**self._labels, "traffic_class": tc}

    def _on_step(self, ev: StepEvent) -> None:
        labels = self._labels
        self.steps.labels(**labels).inc()
        self.tokens_per_step.labels(**labels).observe(ev.num_scheduled_tokens)
        if ev.num_preemptions:
            self.preemptions.labels(**labels).inc(ev.num_preemptions)
        produced = 0
        with self._lock:
            for chunk in ev.chunks:
                if not chunk.produced_token:
                    continue
                produced += 1
                track = self._tracks.get(chunk.request_id)
                if track is None:
                    continue
                if track.last_token_ns is not None:
                    self.itl.labels(**self._lat(track.traffic_class)).observe(
                        _seconds(track.last_token_ns, ev.end_ns)
                    )
                if track.first_token_ns is None:
                    track.first_token_ns = ev.end_ns
                track.last_token_ns = ev.end_ns
        if produced:
            self.generation_tokens.labels(**labels).inc(produced)
        self.running.labels(**labels).set(ev.num_running)
        self.waiting.labels(**labels).set(ev.num_waiting)
        self.kv_used.labels(**labels).set(ev.kv_blocks_used)
        if ev.kv_blocks_total:
            self.kv_usage.labels(**labels).set(ev.kv_blocks_used / ev.kv_blocks_total)
        self.budget.labels(**labels).set(ev.token_budget)
        self.long_prefill.labels(**labels).set(ev.long_prefill_token_threshold)

    def _label_class(self, tc: str) -> str:
        """The label for traffic class ``tc``: bounded in number (called under the lock)."""
        if tc in self._classes:
            return tc
        if len(self._classes) < MAX_TRAFFIC_CLASS_LABELS:
            self._classes.add(tc)
            return tc
        return OTHER_TRAFFIC_CLASS

    def _on_request(self, ev: RequestEvent) -> None:
        with self._lock:
            tc = self._label_class(ev.traffic_class or DEFAULT_TRAFFIC_CLASS)
            if ev.kind == "arrived":
                self._tracks[ev.request_id] = _Track(arrival_ns=ev.time_ns, traffic_class=tc)
                return
            track = self._tracks.get(ev.request_id)
            if track is None:
                return
            lat = self._lat(track.traffic_class)
            if ev.kind == "first_scheduled":
                self.queue_time.labels(**lat).observe(_seconds(track.arrival_ns, ev.time_ns))
            elif ev.kind == "first_token":
                self.ttft.labels(**lat).observe(_seconds(track.arrival_ns, ev.time_ns))
                self.prompt_tokens.labels(**self._labels).inc(ev.num_prompt_tokens)
            elif ev.kind in ("finished", "aborted"):
                del self._tracks[ev.request_id]
                self.e2e.labels(**lat).observe(_seconds(track.arrival_ns, ev.time_ns))
                n = ev.num_output_tokens
                first, last = track.first_token_ns, track.last_token_ns
                if n > 1 and first is not None and last is not None:
                    self.tpot.labels(**lat).observe(_seconds(first, last) / (n - 1))
                reason = ev.finish_reason or ("abort" if ev.kind == "aborted" else "unknown")
                self.requests_finished.labels(**self._labels, finished_reason=reason).inc()

    def refresh(self, stats: Any) -> None:
        """Set the gauges from an ``engine.stats()`` snapshot (call at scrape time)."""
        labels = self._labels
        self.running.labels(**labels).set(stats.num_running)
        self.waiting.labels(**labels).set(stats.num_waiting)
        self.kv_used.labels(**labels).set(stats.kv_blocks_used)
        if stats.kv_blocks_total:
            self.kv_usage.labels(**labels).set(stats.kv_blocks_used / stats.kv_blocks_total)
        self.budget.labels(**labels).set(stats.token_budget)
        self.long_prefill.labels(**labels).set(getattr(stats, "long_prefill_token_threshold", 0))

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
