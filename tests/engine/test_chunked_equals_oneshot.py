"""Chunked prefill computes exactly what a one-shot prefill computes."""

from __future__ import annotations

import random

import torch

from engine.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _run(engine, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    engine.runner.keep_logits = True
    engine.runner.kept_logits.clear()
    rid = engine.add_request(prompt, GREEDY)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens.extend(out.new_token_ids)
    return engine.runner.kept_logits[rid][0], tokens


def test_last_logits_match_one_shot_at_every_budget(make_engine) -> None:
    prompt = _prompt(1000, seed=1)
    engine = make_engine(token_budget=1000, max_token_budget=1000, enable_prefix_caching=False)
    ref_logits, ref_tokens = _run(engine, prompt)
    for budget in (1, 7, 64, 256, 1000):
        assert engine.set_token_budget(budget).accepted
        logits, tokens = _run(engine, prompt)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        assert tokens == ref_tokens, f"budget {budget}"


def test_one_shot_step_layout(make_engine) -> None:
    engine = make_engine(token_budget=64, enable_prefix_caching=False)
    engine.add_request(_prompt(150, 2), GREEDY)
    layouts = []
    while engine.has_unfinished_requests():
        ev = engine.step().event
        assert ev is not None
        layouts.append([(c.kind, c.start, c.num_tokens, c.produced_token) for c in ev.chunks])
    assert layouts[:3] == [
        [("prefill", 0, 64, False)],
        [("prefill", 64, 64, False)],
        [("prefill", 128, 22, True)],
    ]
    assert all(layout == [("decode", 150 + i, 1, True)] for i, layout in enumerate(layouts[3:]))
    assert len(layouts) == 3 + 7


# Prefix-cache hits: tests/engine/core/test_prefix_cache.py (logits against a cold run).


def test_capped_chunks_match_one_shot(make_engine) -> None:
    """The long-prefill cap changes how prompts share a step, never what they compute: a long
    prompt and short ones prefilled together under a cap give the tokens and last-prompt
    logits of each prompt run alone in one shot."""
    prompts = [_prompt(600, seed=3), _prompt(40, seed=4), _prompt(9, seed=5), _prompt(300, 6)]
    engine = make_engine(token_budget=1000, max_token_budget=1000, enable_prefix_caching=False)
    ref = [_run(engine, p) for p in prompts]
    assert engine.set_token_budget(64).accepted
    assert engine.set_long_prefill_token_threshold(16).accepted
    engine.runner.keep_logits = True
    engine.runner.kept_logits.clear()
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    capped = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        assert out.event is not None and out.event.long_prefill_token_threshold == 16
        capped += sum(c.capped for c in out.event.chunks)
        for o in out.outputs:
            tokens[o.request_id].extend(o.new_token_ids)
    assert capped > 0  # the cap did cut chunks
    for rid, (ref_logits, ref_tokens) in zip(rids, ref, strict=True):
        torch.testing.assert_close(engine.runner.kept_logits[rid][0], ref_logits, atol=1e-4, rtol=0)
        assert tokens[rid] == ref_tokens
