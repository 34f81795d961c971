"""The long-prefill cap (``long_prefill_token_threshold``): model-free properties. Outputs under
the cap equal outputs without it: ``test_scheduler.py::test_schedule_properties`` (scheduler) and
``test_chunked_equals_oneshot.py`` (engine, tokens and logits)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, StepPlan

KEY = "long_prefill_token_threshold"


def _req(rid: str, n: int, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [len(rid) % 50 + 1] * n, params, arrival_ns=0)


def _sched(budget: int, cap: int, blocks: int = 4096) -> Scheduler:
    bm = BlockManager(blocks, 4, enable_prefix_caching=False)
    return Scheduler(
        bm, token_budget=budget, max_token_budget=4096, long_prefill_token_threshold=cap
    )


def _sample(plan: StepPlan) -> dict[str, int]:
    return {c.request_id: 7 for c in plan.chunks if c.produces_token}


def test_short_prompt_shares_the_step_and_long_chunk_is_marked_capped() -> None:
    s = _sched(budget=64, cap=16)
    s.add(_req("long", 500))
    p = s.schedule()
    assert [(c.request_id, c.num_tokens, c.capped) for c in p.chunks] == [("long", 64, False)]
    s.update(p, _sample(p), 0)
    s.add(_req("short", 10))
    p = s.schedule()
    assert [(c.request_id, c.num_tokens, c.capped) for c in p.chunks] == [
        ("long", 54, True),  # capped at 16, then given back what "short" did not need
        ("short", 10, False),
    ]
    assert p.long_prefill_token_threshold == 16


def test_cap_is_refused_like_the_budget_and_applies_at_the_next_step() -> None:
    s = _sched(budget=64, cap=0)
    for bad in (-1, 4097, 2.5, "8", True, None):
        r = s.set_long_prefill_token_threshold(bad)
        assert not r.accepted and r.reason and KEY in r.reason
        assert s.long_prefill_token_threshold == 0
    s.add(_req("a", 10))
    s.schedule()
    r = s.set_long_prefill_token_threshold(256)
    assert r.accepted and r.key == KEY and r.old_value == 0 and r.applied_at_step == 1
    assert s.schedule().long_prefill_token_threshold == 256


workload = st.lists(
    st.tuples(st.integers(0, 12), st.integers(1, 300), st.integers(1, 5)),  # step, prompt, out
    min_size=1,
    max_size=10,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=workload,
    budget=st.integers(1, 128),
    cap=st.integers(1, 128),
    blocks=st.sampled_from([40, 4096]),
)
def test_cap_properties(arrivals, budget, cap, blocks) -> None:
    """Budget never exceeded; a prompt is scheduled in the step after it arrives whenever the
    budget minus decodes minus the capped chunks of the prompts ahead of it leaves room (memory
    plentiful); budget is left unused only when no prompt had more to prefill."""
    s = _sched(budget, cap, blocks)
    pending = sorted((step, i, n, out) for i, (step, n, out) in enumerate(arrivals))
    pending = [p for p in pending if p[2] + p[3] <= blocks * 4]
    for step in range(5000):
        new: list[Request] = []
        while pending and pending[0][0] <= step:
            _, i, n, out = pending.pop(0)
            new.append(_req(f"r{i}", n, out))
            s.add(new[-1])
        if not s.has_unfinished() and not pending:
            break
        decodes = sum(1 for r in s.running if not r.is_prefill)
        ahead = sum(min(r.num_remaining, cap) for r in s.running if r.is_prefill)
        ahead += sum(min(r.num_tokens, cap) for r in s.waiting if r not in new)
        plan = s.schedule()
        assert plan.num_scheduled_tokens <= budget
        ids = {c.request_id for c in plan.chunks}
        if blocks == 4096 and not plan.preempted:
            for req in new:
                if budget - decodes - ahead > 0:
                    assert req.request_id in ids, "a waiting prompt waited behind a capped one"
                ahead += min(req.num_tokens, cap)
        if blocks == 4096 and plan.num_scheduled_tokens < budget:
            # work-conserving: budget is left over only when no prompt had more to prefill
            assert not s.waiting
            assert all(c.start + c.num_tokens == c.request.num_tokens for c in plan.chunks)
        s.update(plan, _sample(plan), step)
    else:
        raise AssertionError("did not finish")


@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(2, 512),
    cap=st.integers(1, 512),
    length=st.integers(1, 2000),
    decodes=st.integers(0, 8),
)
def test_lone_long_prompt_gets_the_full_budget(budget, cap, length, decodes) -> None:
    """Work-conserving: with only decodes beside it, a long prompt takes all the budget the
    decodes leave, whatever the cap."""
    s = _sched(budget=4096, cap=cap)
    for i in range(decodes):
        s.add(_req(f"d{i}", 1, max_tokens=50))
    p = s.schedule()
    s.update(p, _sample(p), 0)
    assert s.set_token_budget(budget).accepted
    s.add(_req("long", length))
    p = s.schedule()
    left = budget - min(decodes, budget)
    got = [c.num_tokens for c in p.chunks if c.request_id == "long"]
    assert got == ([min(length, left)] if left else [])
    assert not any(c.capped for c in p.chunks)


def test_leftover_goes_to_the_prompt_nearest_its_end_first() -> None:
    """Two prompts behind the cap: the budget left over finishes the shorter one's prefill
    (its first token comes this step) before the long one takes the rest."""
    s = _sched(budget=100, cap=30)
    s.add(_req("long", 1000))
    p = s.schedule()
    s.update(p, _sample(p), 0)
    s.add(_req("chat", 50))
    p = s.schedule()
    assert [(c.request_id, c.num_tokens, c.capped, c.produces_token) for c in p.chunks] == [
        ("long", 50, True, False),
        ("chat", 50, False, True),
    ]
