"""The stall, by direction, on the ``tiny`` preset: a smaller token budget gives the chat streams
a lower maximum inter-token gap on the same traffic.

Chat requests are decoding when one long prompt arrives. At a large budget the whole prompt is
prefilled in one step that also carries every chat decode: each chat waits for the whole prompt
between two of its tokens. At a small budget the prompt is chunked, no step exceeds the budget
and every chat gets a token in every step. Measured in steps and tokens (the gap of a stream is
the prefill tokens computed between two of its consecutive tokens), never in wall-clock time;
a fixed, known step cost model (``engine.core.cost_model``) turns the recorded steps into a modelled
max chat ITL, which falls with the budget.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine.core.config import EngineConfig
from engine.core.cost_model import CostModel, StepWork, fit
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from wire.events import StepEvent

LARGE_BUDGET = 4096
SMALL_BUDGET = 64
NUM_CHATS = 4
CHAT_PROMPT = 30
CHAT_OUTPUT = 48
LONG_PROMPT = 1800
LONG_OUTPUT = 4
TOKENS_BEFORE_LONG = 4  # every chat has this many tokens when the long prompt arrives
# A known step cost (seconds): overhead + per prefill token + per decode token + per pair.
KNOWN = CostModel(const=1e-3, prefill=2e-5, decode=5e-5, attn=1e-9)


@dataclass
class Run:
    budget: int
    steps: list[StepEvent] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> output tokens
    long_arrival_step: int = -1  # the first step that could schedule the long prompt


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def run_scenario(budget: int) -> Run:
    """The same traffic at ``budget``: the chats first, the long prompt once every chat has
    ``TOKENS_BEFORE_LONG`` tokens; stepped to the end, every step event kept."""
    rng = random.Random(0)
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            token_budget=budget,
            max_token_budget=LARGE_BUDGET,
            enable_prefix_caching=False,
            seed=0,
        )
    )
    assert engine.max_model_len >= LONG_PROMPT + LONG_OUTPUT
    assert engine.block_manager.num_blocks * 16 >= NUM_CHATS * 100 + LONG_PROMPT + 64
    run = Run(budget)
    chat = SamplingParams(max_tokens=CHAT_OUTPUT, temperature=0.0, ignore_eos=True)
    for i in range(NUM_CHATS):
        engine.add_request(
            _prompt(rng, CHAT_PROMPT), chat, request_id=f"chat-{i}", traffic_class="chat"
        )
    long_prompt = _prompt(rng, LONG_PROMPT)
    long_added = False
    while engine.has_unfinished_requests():
        if not long_added and all(
            run.tokens.get(f"chat-{i}", 0) >= TOKENS_BEFORE_LONG for i in range(NUM_CHATS)
        ):
            engine.add_request(
                long_prompt,
                SamplingParams(max_tokens=LONG_OUTPUT, temperature=0.0, ignore_eos=True),
                request_id="long",
                traffic_class="rag",
            )
            long_added = True
            run.long_arrival_step = len(run.steps)
        result = engine.step()
        if result.event is not None:
            run.steps.append(result.event)
        for out in result.outputs:
            run.tokens[out.request_id] = out.num_output_tokens
        assert len(run.steps) < 1000, "the scenario does not end"
    assert long_added
    return run


def chat_gaps(run: Run, measure: dict[int, float]) -> dict[str, list[float]]:
    """For each chat stream, the sum of ``measure[step]`` over the steps from just after one of
    its tokens to the step that produced the next one (inclusive), for every pair of tokens."""
    gaps: dict[str, list[float]] = {}
    last_token_step: dict[str, int] = {}
    for i, step in enumerate(run.steps):
        for c in step.chunks:
            if not c.produced_token or not c.request_id.startswith("chat-"):
                continue
            prev = last_token_step.get(c.request_id)
            if prev is not None:
                gap = sum(measure[s.step] for s in run.steps[prev + 1 : i + 1])
                gaps.setdefault(c.request_id, []).append(gap)
            last_token_step[c.request_id] = i
    return gaps


def prefill_tokens(run: Run) -> dict[int, float]:
    return {s.step: float(s.num_prefill_tokens) for s in run.steps}


def modelled_seconds(run: Run, model: CostModel) -> dict[int, float]:
    return {s.step: model.predict(StepWork.from_chunks(s.chunks)) for s in run.steps}


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    return {"large": run_scenario(LARGE_BUDGET), "small": run_scenario(SMALL_BUDGET)}


def test_same_traffic_same_tokens(runs: dict[str, Run]) -> None:
    expected = {f"chat-{i}": CHAT_OUTPUT for i in range(NUM_CHATS)} | {"long": LONG_OUTPUT}
    for run in runs.values():
        assert run.tokens == expected
        produced = sum(c.produced_token for s in run.steps for c in s.chunks)
        assert produced == sum(expected.values())
        # every prompt token is prefilled exactly once (no prefix cache, no preemption)
        assert sum(s.num_prefill_tokens for s in run.steps) == NUM_CHATS * CHAT_PROMPT + LONG_PROMPT
        assert all(s.num_preemptions == 0 for s in run.steps)


def test_large_budget_prefills_the_long_prompt_in_one_step_with_the_decodes(
    runs: dict[str, Run],
) -> None:
    run = runs["large"]
    long_steps = [s for s in run.steps if any(c.request_id == "long" for c in s.chunks)]
    prefill_steps = [
        s
        for s in long_steps
        if any(c.request_id == "long" and c.kind == "prefill" for c in s.chunks)
    ]
    assert len(prefill_steps) == 1
    stall = prefill_steps[0]
    assert stall.num_prefill_tokens >= LONG_PROMPT
    assert stall.num_decode_tokens == NUM_CHATS
    decoding = {c.request_id for c in stall.chunks if c.kind == "decode" and c.produced_token}
    assert decoding == {f"chat-{i}" for i in range(NUM_CHATS)}
    # each chat waits for the whole prompt between two of its tokens
    gaps = chat_gaps(run, prefill_tokens(run))
    assert set(gaps) == decoding
    for stream in gaps.values():
        assert max(stream) >= LONG_PROMPT


def test_small_budget_chunks_the_prompt_and_the_chats_get_a_token_every_step(
    runs: dict[str, Run],
) -> None:
    run = runs["small"]
    assert all(s.num_scheduled_tokens <= SMALL_BUDGET for s in run.steps)
    assert all(s.token_budget == SMALL_BUDGET for s in run.steps)
    long_prefill = [
        (s, c)
        for s in run.steps
        for c in s.chunks
        if c.request_id == "long" and c.kind == "prefill"
    ]
    assert sum(c.num_tokens for _, c in long_prefill) == LONG_PROMPT
    assert len(long_prefill) >= -(-LONG_PROMPT // SMALL_BUDGET)
    # chunks follow each other through the prompt
    assert [c.start for _, c in long_prefill] == [
        sum(c.num_tokens for _, c in long_prefill[:i]) for i in range(len(long_prefill))
    ]
    for step, _ in long_prefill:
        got = {c.request_id for c in step.chunks if c.kind == "decode" and c.produced_token}
        assert got == {f"chat-{i}" for i in range(NUM_CHATS)}, f"step {step.step}"
    gaps = chat_gaps(run, prefill_tokens(run))
    assert len(gaps) == NUM_CHATS
    for stream in gaps.values():
        assert len(stream) == CHAT_OUTPUT - 1
        assert max(stream) <= SMALL_BUDGET


def test_smaller_budget_lowers_the_max_chat_gap(runs: dict[str, Run]) -> None:
    """The direction, in prefill tokens between two chat tokens and in modelled seconds."""
    large, small = runs["large"], runs["small"]
    gap_large = max(max(g) for g in chat_gaps(large, prefill_tokens(large)).values())
    gap_small = max(max(g) for g in chat_gaps(small, prefill_tokens(small)).values())
    assert gap_small <= SMALL_BUDGET < LONG_PROMPT <= gap_large

    itl_large = max(max(g) for g in chat_gaps(large, modelled_seconds(large, KNOWN)).values())
    itl_small = max(max(g) for g in chat_gaps(small, modelled_seconds(small, KNOWN)).values())
    assert itl_small < itl_large
    # the modelled stall is the prompt's prefill: at least its per-token cost
    assert itl_large >= KNOWN.prefill * LONG_PROMPT
    # chunking pays per-step overhead: the same work in one more step (deterministic here)
    total_large = sum(modelled_seconds(large, KNOWN).values())
    total_small = sum(modelled_seconds(small, KNOWN).values())
    assert len(small.steps) > len(large.steps)
    assert total_small > total_large


def test_fit_recovers_the_known_model_from_the_recorded_steps(runs: dict[str, Run]) -> None:
    """The recorded layouts of both runs, timed by the known model, give back its
    coefficients (the features vary enough across the two budgets)."""
    works = [StepWork.from_chunks(s.chunks) for run in runs.values() for s in run.steps]
    model = fit(works, [KNOWN.predict(w) for w in works])
    assert model.const == pytest.approx(KNOWN.const, rel=1e-3)
    assert model.prefill == pytest.approx(KNOWN.prefill, rel=1e-3)
    assert model.decode == pytest.approx(KNOWN.decode, rel=1e-3)
    assert model.attn == pytest.approx(KNOWN.attn, rel=1e-3)
