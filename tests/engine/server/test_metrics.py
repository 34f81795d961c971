"""Prometheus metrics: fed from synthetic events (times in monotonic ns), and checked against
the event stream of a real ``tiny`` engine."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from engine.core.sampling_params import SamplingParams
from engine.server.metrics import MAX_TRAFFIC_CLASS_LABELS, EngineMetrics
from wire.events import ChunkRecord, RequestEvent, StepEvent

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


def test_traffic_class_labels_are_bounded() -> None:
    """A client choosing a new X-Traffic-Class per request cannot grow the series without end."""
    m = EngineMetrics("tiny", "e0")
    for i in range(MAX_TRAFFIC_CLASS_LABELS + 50):
        m.on_event(RequestEvent("arrived", f"r{i}", 0, traffic_class=f"c{i}"))
        m.on_event(RequestEvent("first_scheduled", f"r{i}", _ns(0.5), traffic_class=f"c{i}"))
    s = _samples(m.render()[0].decode())
    classes = {
        k.split("traffic_class=")[1].rstrip("}")
        for k in s
        if k.startswith("chunkscope:request_queue_time_seconds_count{")
    }
    assert len(classes) == MAX_TRAFFIC_CLASS_LABELS + 1 and "other" in classes and "c0" in classes
    base = "engine_id=e0,model_name=tiny"
    assert s["chunkscope:request_queue_time_seconds_count{" + base + ",traffic_class=other}"] == 50


def test_registries_are_independent() -> None:
    a, b = EngineMetrics("tiny", "a"), EngineMetrics("tiny", "b")
    a.on_event(_step(0, 1.0, []))
    assert 'engine_id="b"' not in a.render()[0].decode()
    assert 'engine_id="a"' not in b.render()[0].decode()
    sa, sb = _samples(a.render()[0].decode()), _samples(b.render()[0].decode())
    assert sa["chunkscope:steps_total{engine_id=a,model_name=tiny}"] == 1
    assert sb["chunkscope:steps_total{engine_id=b,model_name=tiny}"] == 0


def test_budget_gauge_follows_an_accepted_change_before_the_next_step() -> None:
    from wire.events import ControlEvent

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


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 256 for i in range(n)]


def test_metrics_equal_the_event_stream_of_a_real_engine(make_engine) -> None:
    """Every latency is a difference of the engine's own event times: TTFT, ITL, TPOT, queue
    time and e2e per request (one traffic class each, so each histogram holds one request)."""
    engine = make_engine(token_budget=32)
    metrics = EngineMetrics(engine.model_name, engine.engine_id)
    events: list[object] = []
    engine.add_listener(metrics.on_event)
    engine.add_listener(events.append)
    # (prompt tokens, output tokens): the first three prompts share the first step, so each
    # arrives and gets its first token in that step; the last prompt spans two steps.
    specs = [(10, 2), (10, 5), (10, 3), (40, 4)]
    rids = [
        engine.add_request(
            _prompt(n, i), SamplingParams(max_tokens=mt, ignore_eos=True), traffic_class=f"c{i}"
        )
        for i, (n, mt) in enumerate(specs)
    ]
    while engine.has_unfinished_requests():
        engine.step()

    steps = [e for e in events if isinstance(e, StepEvent)]
    req_events = {(e.request_id, e.kind): e for e in events if isinstance(e, RequestEvent)}
    s = _samples(metrics.render()[0].decode())
    base = "engine_id=" + engine.engine_id + ",model_name=" + engine.model_name

    def sample(name: str, tc: str) -> float:
        return s["chunkscope:" + name + "{" + base + ",traffic_class=" + tc + "}"]

    for i, (rid, (_, n)) in enumerate(zip(rids, specs, strict=True)):
        tc = f"c{i}"
        token_ns = [
            st.end_ns for st in steps for c in st.chunks if c.request_id == rid and c.produced_token
        ]
        assert len(token_ns) == n
        arrival = req_events[(rid, "arrived")].time_ns
        gaps = [(b - a) / S for a, b in zip(token_ns, token_ns[1:], strict=False)]
        itl_sum = 0.0
        for g in gaps:  # the histogram adds its observations in this order
            itl_sum += g
        assert sample("time_to_first_token_seconds_sum", tc) == (token_ns[0] - arrival) / S
        assert sample("inter_token_latency_seconds_count", tc) == n - 1
        assert sample("inter_token_latency_seconds_sum", tc) == itl_sum
        tpot = ((token_ns[-1] - token_ns[0]) / S) / (n - 1)
        assert sample("request_time_per_output_token_seconds_sum", tc) == tpot > 0
        first_scheduled = req_events[(rid, "first_scheduled")].time_ns
        assert sample("request_queue_time_seconds_sum", tc) == (first_scheduled - arrival) / S
        finished = req_events[(rid, "finished")].time_ns
        assert finished == token_ns[-1]
        assert sample("e2e_request_latency_seconds_sum", tc) == (finished - arrival) / S
    # the 2-token request: TPOT is the gap between the end times of its two steps
    two = [st.end_ns for st in steps if any(c.request_id == rids[0] for c in st.chunks)]
    assert len(two) == 2
    assert sample("request_time_per_output_token_seconds_sum", "c0") == (two[1] - two[0]) / S
    assert s["chunkscope:steps_total{" + base + "}"] == len(steps)
    assert s["chunkscope:generation_tokens_total{" + base + "}"] == sum(mt for _, mt in specs)
    assert s["chunkscope:prompt_tokens_total{" + base + "}"] == sum(n for n, _ in specs)
    reason = "{engine_id=" + engine.engine_id + ",finished_reason=length,model_name=tiny}"
    assert s["chunkscope:request_success_total" + reason] == 4


def test_stop_reason_of_an_abort_is_counted_as_stop(make_engine) -> None:
    engine = make_engine()
    metrics = EngineMetrics(engine.model_name, engine.engine_id)
    engine.add_listener(metrics.on_event)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    stopped = engine.add_request(_prompt(12, 1), params)
    aborted = engine.add_request(_prompt(12, 2), params)
    for _ in range(3):
        engine.step()
    engine.abort_request(stopped, reason="stop")  # as the server does when a stop string matched
    engine.abort_request(aborted)
    engine.step()
    assert not engine.has_unfinished_requests()
    s = _samples(metrics.render()[0].decode())
    for reason in ("stop", "abort"):
        labels = f"engine_id={engine.engine_id},finished_reason={reason},model_name=tiny"
        assert s["chunkscope:request_success_total{" + labels + "}"] == 1
