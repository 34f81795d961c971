"""Scheduler unit and property tests: no model, no torch. A fake "model" samples a token that is a
function of the sequence so far, so any schedule must produce the same outputs."""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, StepPlan


def make_request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_ns=0
    )


def fake_sample(plan: StepPlan) -> dict[str, int]:
    return {c.request_id: sum(c.request.token_ids) % 251 for c in plan.chunks if c.produces_token}


def make_scheduler(
    budget: int = 16,
    blocks: int = 64,
    block_size: int = 4,
    policy: str = "chunked",
    caching: bool = True,
) -> Scheduler:
    bm = BlockManager(blocks, block_size, caching)
    return Scheduler(bm, token_budget=budget, max_token_budget=4096, policy=policy)


def test_decodes_first_then_partial_prefills_then_waiting() -> None:
    s = make_scheduler(budget=10)
    a, b, c = make_request("a", [1] * 3), make_request("b", [2] * 20), make_request("c", [3] * 5)
    for r in (a, b, c):
        s.add(r)
    p0 = s.schedule()
    assert [(x.request_id, x.kind, x.start, x.num_tokens) for x in p0.chunks] == [
        ("a", "prefill", 0, 3),
        ("b", "prefill", 0, 7),
    ]
    s.update(p0, fake_sample(p0), 0)
    p1 = s.schedule()
    assert [(x.request_id, x.kind, x.start, x.num_tokens) for x in p1.chunks] == [
        ("a", "decode", 3, 1),
        ("b", "prefill", 7, 9),
    ]
    s.update(p1, fake_sample(p1), 0)
    p2 = s.schedule()
    assert [(x.request_id, x.kind, x.num_tokens) for x in p2.chunks] == [
        ("a", "decode", 1),
        ("b", "prefill", 4),
        ("c", "prefill", 5),
    ]


def test_budget_smaller_than_decodes_serves_oldest_first() -> None:
    s = make_scheduler(budget=8)
    reqs = [make_request(f"r{i}", [i + 1], max_tokens=10) for i in range(5)]
    for r in reqs:
        s.add(r)
    p = s.schedule()
    s.update(p, fake_sample(p), 0)
    assert s.set_token_budget(3).applied_at_step == 1
    p = s.schedule()
    assert p.token_budget == 3 and p.step == 1
    assert [c.request_id for c in p.chunks] == ["r0", "r1", "r2"]


def test_unchunked_never_splits_and_always_admits_one() -> None:
    s = make_scheduler(budget=8, policy="unchunked")
    s.add(make_request("short", [1] * 4, max_tokens=3))
    s.add(make_request("long", [2] * 30))
    p = s.schedule()
    assert [(c.request_id, c.num_tokens) for c in p.chunks] == [("short", 4)]
    s.update(p, fake_sample(p), 0)
    p = s.schedule()  # "long" does not fit the budget, but no other prompt is prefilling
    assert [(c.request_id, c.kind, c.num_tokens) for c in p.chunks] == [
        ("short", "decode", 1),
        ("long", "prefill", 30),
    ]


def test_bad_budget_and_policy_are_refused_and_keep_old_values() -> None:
    s = make_scheduler(budget=16)
    for bad in (0, -1, 4097, 2.5, "8", True, None):
        r = s.set_token_budget(bad)
        assert not r.accepted and r.reason and s.token_budget == 16
    r = s.set_policy("fastest")
    assert not r.accepted and "chunked" in (r.reason or "") and s.policy == "chunked"


def test_preemption_recomputes_most_recent_arrival() -> None:
    s = make_scheduler(budget=64, blocks=6, block_size=4)
    old, new = make_request("old", [1] * 10, max_tokens=8), make_request("new", [2] * 10, 8)
    s.add(old)
    s.add(new)
    preempted = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        p = s.schedule()
        preempted += [r.request_id for r in p.preempted]
        s.update(p, fake_sample(p), 0)
    assert preempted and set(preempted) == {"new"}
    assert not s.has_unfinished() and s.block_manager.num_used_blocks == 0


def test_scheduler_imports_no_torch() -> None:
    import subprocess

    code = (
        "import sys, engine.core.scheduler, engine.core.block_manager, engine.core.config;"
        "import wire.events;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- properties -------------------------------------------------------------------------------
arrival = st.tuples(
    st.integers(0, 30),  # step at which it arrives
    st.integers(1, 60),  # prompt length
    st.integers(1, 6),  # max tokens
    st.integers(0, 3),  # which shared prefix (0: none)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=12),
    budgets=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 48)), max_size=6),
    blocks=st.integers(20, 60),
    policy=st.sampled_from(["chunked", "unchunked"]),
    caps=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 24)), min_size=1, max_size=4),
)
def test_schedule_properties(arrivals, budgets, blocks, policy, caps) -> None:
    outputs, prefill_tokens = _simulate(arrivals, budgets, blocks, policy, caching=False)
    cached_outputs, cached_prefill = _simulate(arrivals, budgets, blocks, policy, caching=True)
    assert cached_outputs == outputs  # prefix caching changes no output
    assert cached_prefill <= prefill_tokens
    # the long-prefill cap, changed live, changes no output either (and keeps every property)
    capped_outputs, _ = _simulate(arrivals, budgets, blocks, policy, caching=True, caps=caps)
    assert capped_outputs == outputs


def _simulate(arrivals, budgets, blocks, policy, caching, caps=()):
    block_size = 4
    s = make_scheduler(
        budget=16, blocks=blocks, block_size=block_size, policy=policy, caching=caching
    )
    prefixes = {k: [100 + k] * (8 * k) for k in range(4)}
    pending = sorted(
        (step, i, prefixes[pre] + [i % 7 + 1] * length, mt)
        for i, (step, length, mt, pre) in enumerate(arrivals)
    )
    pending = [p for p in pending if len(p[2]) + p[3] <= blocks * block_size]
    changes = dict(budgets)
    cap_changes = dict(caps)
    reqs: dict[str, Request] = {}
    computed: dict[str, int] = {}
    prefill_total = 0
    for step in range(3000):
        while pending and pending[0][0] <= step:
            _, i, prompt, mt = pending.pop(0)
            r = make_request(f"r{i}", prompt, mt)
            reqs[r.request_id] = r
            computed[r.request_id] = 0
            s.add(r)
        if step in changes:
            res = s.set_token_budget(changes[step])
            assert res.accepted and res.applied_at_step == s.next_step
        if step in cap_changes:
            res = s.set_long_prefill_token_threshold(cap_changes[step])
            assert res.accepted and res.applied_at_step == s.next_step
        if not s.has_unfinished() and not pending:
            break
        decodes_before = [r for r in s.running if not r.is_prefill]
        budget = s.token_budget
        plan = s.schedule()
        assert plan.token_budget == budget  # a change applies at the next step
        assert plan.long_prefill_token_threshold == s.long_prefill_token_threshold
        # the budget is never exceeded (unchunked: only by one whole prompt)
        if policy == "chunked":
            assert plan.num_scheduled_tokens <= budget
        elif plan.num_scheduled_tokens > budget:
            assert len([c for c in plan.chunks if c.kind == "prefill"]) == 1
        # decodes advance every step when the budget allows
        if len(decodes_before) <= budget and not plan.preempted:
            got = {c.request_id for c in plan.chunks if c.kind == "decode"}
            assert {r.request_id for r in decodes_before} <= got
        for r in plan.preempted:
            computed[r.request_id] = 0
        for c in plan.chunks:
            req = c.request
            # every position computed once, in order (a prefix-cache hit skips ahead)
            if c.start != computed[c.request_id]:
                assert caching and c.start > computed[c.request_id]
                assert c.start % block_size == 0 and computed[c.request_id] == 0
            computed[c.request_id] = c.start + c.num_tokens
            assert c.start + c.num_tokens <= req.num_tokens
        prefill_total += plan.num_prefill_tokens
        s.update(plan, fake_sample(plan), step)
    else:
        raise AssertionError("simulation did not finish")
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs.values())
    bm = s.block_manager
    assert bm.num_used_blocks == 0 and all(c == 0 for c in bm.ref_counts)  # no leaks
    return {rid: r.output_token_ids for rid, r in reqs.items()}, prefill_total


# --- image tokens weighted in the budget --------------------------------------------------------
def _image_request(
    rid: str, text_before: int, image_hw: tuple[int, int], text_after: int
) -> Request:
    """A prompt: ``text_before`` text tokens, one image's placeholders (id 9), ``text_after``."""
    import numpy as np

    from engine.core.request import ImageInput

    image = ImageInput(np.zeros((*image_hw, 3), dtype=np.uint8), f"hash-{rid}")
    prompt = [1] * text_before + [9] * image.num_tokens + [2] * text_after
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=2, ignore_eos=True),
        arrival_ns=0,
        images=[image],
        image_token_id=9,
    )


def _weighted(budget: int, cost: float, blocks: int = 256) -> Scheduler:
    bm = BlockManager(blocks, 4, True)
    return Scheduler(bm, token_budget=budget, max_token_budget=4096, image_token_cost=cost)


def test_image_tokens_take_their_cost_from_the_budget() -> None:
    # 10 text tokens, a 280x280 image (100 tokens), 10 text tokens; budget 40 at cost 2:
    # step 1 = 10 text + 15 image tokens (10 + 30 = 40), then 20 image tokens a step.
    s = _weighted(budget=40, cost=2.0)
    req = _image_request("img", 10, (280, 280), 10)
    s.add(req)
    sizes = []
    while req.is_prefill or req.num_computed_tokens == 0:
        plan = s.schedule()
        sizes.append(plan.chunks[0].num_tokens)
        s.update(plan, fake_sample(plan), now_ns=0)
    assert sizes == [25, 20, 20, 20, 20, 15]  # the last: 5 image tokens (10) + the 10 text
    assert sum(sizes) == req.num_prompt_tokens


def test_image_cost_one_schedules_as_plain_tokens() -> None:
    s = _weighted(budget=40, cost=1.0)
    req = _image_request("img", 10, (280, 280), 10)
    s.add(req)
    plan = s.schedule()
    assert plan.chunks[0].num_tokens == 40


def test_image_cost_shares_the_budget_with_decodes_and_text() -> None:
    # a decode takes 1; a text prompt before the image request takes its 9; the image
    # request gets what is left at 3 budget tokens per image token
    s = _weighted(budget=40, cost=3.0)
    d = make_request("d", [5] * 4, max_tokens=8)
    s.add(d)
    plan = s.schedule()
    s.update(plan, fake_sample(plan), now_ns=0)
    t = make_request("t", [6] * 9)
    img = _image_request("img", 0, (280, 280), 0)
    s.add(t)
    s.add(img)
    plan = s.schedule()
    sizes = {c.request_id: c.num_tokens for c in plan.chunks}
    assert sizes == {"d": 1, "t": 9, "img": 10}  # 1 + 9 + 10 * 3 = 40


def test_image_token_cost_out_of_range_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="image_token_cost"):
        _weighted(budget=40, cost=0.5)


def test_an_image_token_dearer_than_the_budget_still_goes_one_a_step() -> None:
    s = _weighted(budget=1, cost=3.0)
    req = _image_request("img", 0, (56, 56), 0)  # 4 image tokens
    s.add(req)
    steps = 0
    while req.is_prefill or req.num_computed_tokens == 0:
        plan = s.schedule()
        assert [c.num_tokens for c in plan.chunks] == [1]
        s.update(plan, fake_sample(plan), now_ns=0)
        steps += 1
    assert steps == 4
