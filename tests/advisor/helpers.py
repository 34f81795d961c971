"""Writing a simulated run into a store, as an engine's telemetry would (contract event dicts
through ``storage.store.Store``), so the advisor's store readers can be checked on known data."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from advisor.simulate import EngineShape, SimRequest, SimResult
from storage import db as dbm
from storage.store import Events, Hello, Store
from wire.events import ChunkRecord, RequestEvent, StepEvent

MONO0 = 10**12


def random_requests(
    seed: int,
    n: int,
    *,
    classes: Sequence[str] = ("chat", "rag"),
    prompt: tuple[int, int] = (8, 400),
    output: tuple[int, int] = (1, 40),
    spacing_ms: tuple[int, int] = (0, 30),
) -> list[SimRequest]:
    """``n`` requests with unique prompts, arriving on whole milliseconds plus 0.5 ms (so no
    arrival ever coincides with a step boundary of a whole-microsecond step clock)."""
    rng = random.Random(seed)
    t_ms = 0
    out = []
    for i in range(n):
        t_ms += rng.randint(*spacing_ms)
        length = rng.randint(*prompt)
        out.append(
            SimRequest(
                request_id=f"req-{i}",
                arrival_ns=t_ms * 1_000_000 + 500_000,
                prompt_token_ids=tuple(i * 100_000 + p for p in range(length)),
                num_output_tokens=rng.randint(*output),
                traffic_class=classes[i % len(classes)],
            )
        )
    return out


def hello(engine_id: str, run_id: str, shape: EngineShape, budget: int, wall_ns: int) -> dict:
    return {
        "schema": 1,
        "type": "hello",
        "engine_id": engine_id,
        "run_id": run_id,
        "model": "simulated",
        "host": "localhost",
        "pid": 1,
        "policy": shape.policy,
        "token_budget": budget,
        "max_token_budget": shape.max_token_budget,
        "kv_blocks_total": shape.num_kv_blocks,
        "block_size": shape.block_size,
        "config": {
            "model": "simulated",
            "token_budget": budget,
            "max_token_budget": shape.max_token_budget,
            "policy": shape.policy,
            "block_size": shape.block_size,
            "num_kv_blocks": shape.num_kv_blocks,
            "max_num_seqs": shape.max_num_seqs,
            "max_model_len": None,
            "enable_prefix_caching": shape.enable_prefix_caching,
        },
        "clock": {"wall_ns": wall_ns, "mono_ns": MONO0},
        # a vLLM engine's hello says so (the bridge's engine_kind)
        **({"engine_kind": "vllm"} if shape.scheduler == "vllm" else {}),
    }


def run_events(requests: Sequence[SimRequest], result: SimResult) -> list[dict[str, Any]]:
    """The contract events of a recorded simulation (``record_steps=True``), in causal order,
    times shifted onto the monotonic clock at ``MONO0``."""
    by_id = {r.request_id: r for r in requests}
    pending = sorted(requests, key=lambda r: r.arrival_ns)
    outputs = {r.request_id: 0 for r in requests}
    scheduled: set[str] = set()
    live: set[str] = set()
    events: list[dict[str, Any]] = []
    i = 0

    def req_event(kind: str, r: SimRequest, t: int, step: int | None) -> dict[str, Any]:
        return RequestEvent(
            kind=kind,
            request_id=r.request_id,
            time_ns=MONO0 + t,
            traffic_class=r.traffic_class,
            num_prompt_tokens=len(r.prompt_token_ids),
            num_output_tokens=outputs[r.request_id],
            finish_reason="length" if kind == "finished" else None,
            step=step,
        ).to_dict()

    for s in result.steps:
        while i < len(pending) and pending[i].arrival_ns <= s.start_ns:
            events.append(req_event("arrived", pending[i], pending[i].arrival_ns, None))
            live.add(pending[i].request_id)
            i += 1
        for c in s.chunks:
            if c.request_id not in scheduled:
                scheduled.add(c.request_id)
                events.append(req_event("first_scheduled", by_id[c.request_id], s.start_ns, s.step))
        after: list[dict[str, Any]] = []
        for c in s.chunks:
            if not c.produced_token:
                continue
            r = by_id[c.request_id]
            outputs[r.request_id] += 1
            if outputs[r.request_id] == 1:
                after.append(req_event("first_token", r, s.end_ns, s.step))
            if outputs[r.request_id] == r.num_output_tokens:
                after.append(req_event("finished", r, s.end_ns, s.step))
                live.discard(r.request_id)
        running = sum(1 for rid in live if rid in scheduled)
        step = StepEvent(
            step=s.step,
            start_ns=MONO0 + s.start_ns,
            end_ns=MONO0 + s.end_ns,
            token_budget=s.token_budget,
            policy="chunked",
            num_decode_tokens=sum(c.num_tokens for c in s.chunks if c.kind == "decode"),
            num_prefill_tokens=sum(c.num_tokens for c in s.chunks if c.kind == "prefill"),
            num_scheduled_tokens=sum(c.num_tokens for c in s.chunks),
            num_running=running,
            num_waiting=len(live) - running,
            kv_blocks_used=0,
            kv_blocks_total=1,
            num_preemptions=s.num_preemptions,
            chunks=[
                ChunkRecord(c.request_id, c.kind, c.start, c.num_tokens, c.produced_token)
                for c in s.chunks
            ],
            forward_ns=s.end_ns - s.start_ns,
        ).to_dict()
        events.append(step)
        events.extend(after)
    for seq, e in enumerate(events, start=1):
        e["seq"] = seq
    return events


def store_run(
    db_url: str,
    requests: Sequence[SimRequest],
    result: SimResult,
    shape: EngineShape,
    *,
    engine_id: str = "engine-sim",
    run_id: str = "run-1",
    wall_ns: int | None = None,
) -> int:
    """Write the run into the store at ``db_url`` (migrated here); returns the clock's wall_ns
    (wall seconds of simulation time t are ``(wall_ns + t) / 1e9``)."""
    wall_ns = wall_ns if wall_ns is not None else (time.time_ns() // 10**9) * 10**9
    db = dbm.connect(db_url)
    dbm.migrate(db)
    events = run_events(requests, result)
    for e in events:  # the run's steps report the real cache size
        if e["type"] == "step":
            e["kv_blocks_total"] = shape.num_kv_blocks
    store = Store(db)
    try:
        (info,) = store.apply(
            [Hello(hello(engine_id, run_id, shape, result.token_budget, wall_ns))]
        )
        for k in range(0, len(events), 500):
            store.apply([Events(info.run_key, events[k : k + 500])])
    finally:
        store.close()
        db.dispose()
    return wall_ns
