"""Prometheus metrics fed from synthetic engine events (times in monotonic ns)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.events import ChunkRecord, RequestEvent, StepEvent
from engine.metrics import EngineMetrics

S = 1_000_000_000  # nanoseconds per second


def _ns(t: float) -> int:
    return round(t * S)


def _step(i: int, t: float, chunks: list[ChunkRecord], **kw: int) -> StepEvent:
    return StepEvent(
        step=i,
        start_ns=_ns(t - 0.01),
        end_ns=_ns(t),
        token_budget=kw.get("budget", 64),
        policy="chunked",
        num_decode_tokens=0,
        num_prefill_tokens=0,
        num_scheduled_tokens=sum(c.num_tokens for c in chunks),
        num_running=1,
        num_waiting=0,
        kv_blocks_used=kw.get("used", 3),
        kv_blocks_total=10,
        num_preemptions=kw.get("preempt", 0),
        chunks=chunks,
    )


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = s.value
    return out


def test_metrics_from_events() -> None:
    m = EngineMetrics("tiny", "e0")
    rid = "r1"
    m.on_event(RequestEvent("arrived", rid, 0, traffic_class="rag", num_prompt_tokens=40))
    m.on_event(RequestEvent("first_scheduled", rid, _ns(0.5), traffic_class="rag"))
    m.on_event(_step(0, 1.0, [ChunkRecord(rid, "prefill", 0, 32, False)]))
    m.on_event(_step(1, 2.0, [ChunkRecord(rid, "prefill", 32, 8, True)], preempt=1))
    m.on_event(
        RequestEvent("first_token", rid, _ns(2.0), traffic_class="rag", num_prompt_tokens=40)
    )
    m.on_event(_step(2, 2.5, [ChunkRecord(rid, "decode", 40, 1, True)]))
    m.on_event(_step(3, 3.5, [ChunkRecord(rid, "decode", 41, 1, True)], budget=128))
    m.on_event(
        RequestEvent(
            "finished",
            rid,
            _ns(3.5),
            traffic_class="rag",
            num_output_tokens=3,
            finish_reason="length",
        )
    )
    m.on_event(object())  # ignored, never raises
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    s = _samples(body.decode())
    base = "engine_id=e0,model_name=tiny"
    lat = base + ",traffic_class=rag"
    assert s["chunkscope:steps_total{" + base + "}"] == 4
    assert s["chunkscope:generation_tokens_total{" + base + "}"] == 3
    assert s["chunkscope:prompt_tokens_total{" + base + "}"] == 40
    assert s["chunkscope:num_preemptions_total{" + base + "}"] == 1
    assert s["chunkscope:tokens_per_step_count{" + base + "}"] == 4  # prefill-only step counted
    assert s["chunkscope:time_to_first_token_seconds_sum{" + lat + "}"] == 2.0
    assert s["chunkscope:request_queue_time_seconds_sum{" + lat + "}"] == 0.5
    assert s["chunkscope:e2e_request_latency_seconds_sum{" + lat + "}"] == 3.5
    assert s["chunkscope:inter_token_latency_seconds_count{" + lat + "}"] == 2
    assert s["chunkscope:inter_token_latency_seconds_sum{" + lat + "}"] == 1.5
    assert s["chunkscope:request_time_per_output_token_seconds_sum{" + lat + "}"] == 0.75
    assert s["chunkscope:token_budget{" + base + "}"] == 128
    assert s["chunkscope:kv_cache_usage_perc{" + base + "}"] == 0.3

    m.refresh(
        SimpleNamespace(
            num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=10, token_budget=32
        )
    )
    s = _samples(m.render()[0].decode())
    assert s["chunkscope:kv_cache_usage_perc{" + base + "}"] == 0.0
    assert s["chunkscope:token_budget{" + base + "}"] == 32


def test_registries_are_independent() -> None:
    a, b = EngineMetrics("tiny", "a"), EngineMetrics("tiny", "b")
    a.on_event(_step(0, 1.0, []))
    assert 'engine_id="b"' not in a.render()[0].decode()
    assert b.render()[0]


def test_budget_gauge_follows_an_accepted_change_before_the_next_step() -> None:
    from engine.events import ControlEvent

    m = EngineMetrics(model_name="m", engine_id="e")
    m.on_event(
        ControlEvent(
            key="token_budget",
            old_value=512,
            new_value=64,
            accepted=True,
            time_ns=0,
            applied_at_step=3,
        )
    )
    m.on_event(
        ControlEvent(
            key="token_budget", old_value=64, new_value=0, accepted=False, time_ns=0, reason="bad"
        )
    )
    text = m.render()[0].decode()
    assert 'chunkscope:token_budget{engine_id="e",model_name="m"} 64.0' in text
