"""The simulator reproduces the real engine's step plans exactly.

A real ``tiny`` ``LLMEngine`` runs in-process on this thread: requests (some sharing prefixes,
so the prefix cache hits; a small KV cache, so requests are preempted) arrive between chosen
steps, and the budget changes live three times. A listener records every event. The simulator
then gets the same requests, each arriving right before the step the engine admitted it at, the
same budget and long-prefill cap changes at the steps they applied at, and a constant step time;
every simulated step must equal the recorded one chunk by chunk, in order (request, kind, start,
tokens, whether it produced a token, whether the cap cut it), with the same budget, the same cap
and the same number of preemptions.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from advisor.simulate import EngineShape, SimRequest, simulate
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from wire.events import ControlEvent, RequestEvent, StepEvent

STEP_NS = 1_000
BLOCKS, BLOCK_SIZE, MAX_SEQS = 40, 8, 6


def _record(policy: str, seed: int) -> tuple[list[Any], dict[str, tuple[list[int], int]]]:
    config = EngineConfig(
        model="tiny",
        device="cpu",
        token_budget=48,
        max_model_len=512,
        num_kv_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_SEQS,
        policy=policy,
    )
    engine = LLMEngine(config)
    events: list[Any] = []
    engine.add_listener(events.append)
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(40)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(14):
        at = rng.choice([0, 0, 1, 2, 3, 5, 8, 9, 13, 20, 21, 30])
        prompt = shared[: rng.choice([0, 16, 24, 40])]
        prompt += [rng.randrange(256) for _ in range(rng.randrange(5, 120))]
        arrivals.setdefault(at, []).append((f"r{i}", prompt, rng.randrange(1, 40)))
    budgets = {10: 16, 25: 100, 40: 7}
    caps = {3: 12, 18: 0, 27: 30}  # the long-prefill cap, changed live too
    sent: dict[str, tuple[list[int], int]] = {}
    count = 0
    while True:
        for rid, prompt, n_out in arrivals.pop(count, []):
            sent[rid] = (prompt, n_out)
            params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
            engine.add_request(prompt, params, request_id=rid)
        if count in budgets:
            engine.set_token_budget(budgets[count])
        if count in caps:
            engine.set_long_prefill_token_threshold(caps[count])
        if not engine.has_unfinished_requests():
            assert not arrivals, "the engine went idle before every request arrived"
            break
        assert engine.step().event is not None, "every step of this run schedules tokens"
        count += 1
    return events, sent


def _plan(step: Any) -> tuple:
    return (
        step.step,
        step.token_budget,
        step.long_prefill_token_threshold,
        [
            (c.request_id, c.kind, c.start, c.num_tokens, c.produced_token, c.capped)
            for c in step.chunks
        ],
        step.num_preemptions,
    )


@pytest.mark.parametrize(("policy", "seed"), [("chunked", 1), ("chunked", 7), ("unchunked", 1)])
def test_simulated_step_plans_equal_the_engines(policy: str, seed: int) -> None:
    events, sent = _record(policy, seed)
    steps = [e for e in events if isinstance(e, StepEvent)]
    # the step each request was admitted before: its "arrived" event precedes that step's event
    admitted_at: dict[str, int] = {}
    n = 0
    for e in events:
        if isinstance(e, StepEvent):
            n += 1
        elif isinstance(e, RequestEvent) and e.kind == "arrived":
            admitted_at[e.request_id] = n
    changes = [
        (e.applied_at_step * STEP_NS - 1, e.new_value)
        for e in events
        if isinstance(e, ControlEvent) and e.accepted and e.key == "token_budget"
    ]
    assert len(changes) == 3
    cap_changes = [
        (e.applied_at_step * STEP_NS - 1, e.new_value)
        for e in events
        if isinstance(e, ControlEvent) and e.accepted and e.key == "long_prefill_token_threshold"
    ]
    assert len(cap_changes) == 3
    reqs = [
        SimRequest(rid, admitted_at[rid] * STEP_NS - 1, tuple(prompt), n_out, None)
        for rid, (prompt, n_out) in sent.items()
    ]
    shape = EngineShape(
        num_kv_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        max_num_seqs=MAX_SEQS,
        max_model_len=512,
        policy=policy,
    )
    result = simulate(
        reqs,
        shape,
        token_budget=48,
        step_ns=lambda plan: STEP_NS,
        budget_changes=changes,
        cap_changes=cap_changes,
        record_steps=True,
    )
    assert result.unfinished == 0
    real = [_plan(s) for s in steps]
    simulated = [_plan(s) for s in result.steps]
    assert len(simulated) == len(real)
    for r, s in zip(real, simulated, strict=True):
        assert s == r
    # the run exercised what makes the replay hard
    assert sum(s.num_preemptions for s in steps) > 0 or policy == "unchunked"
    assert any(c.start > 0 and c.kind == "prefill" for s in steps for c in s.chunks)
    assert {s.token_budget for s in steps} == {48, 16, 100, 7}
    assert {s.long_prefill_token_threshold for s in steps} == {0, 12, 30}
    assert any(c.capped for s in steps for c in s.chunks) or policy == "unchunked"
    # every request produced its tokens at the same steps
    real_tokens = {rid: [] for rid in sent}
    for s in steps:
        for c in s.chunks:
            if c.produced_token:
                real_tokens[c.request_id].append(s.step)
    sim_tokens = {o.request_id: [t // STEP_NS for t in o.token_times_ns] for o in result.requests}
    assert sim_tokens == real_tokens
