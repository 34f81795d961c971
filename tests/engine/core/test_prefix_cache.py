"""Prefix caching changes nothing a client can see: with and without cache hits the logits behind
every sampled token are the same as a cold run's.

Engine tests compare logits (not only greedy tokens) against an engine with the cache off, for a
whole-prompt hit, a hit that ends in the middle of a block, a hit over blocks that decode steps
wrote, and hits over an image span (the image's content hash is part of the block hash, so the same
placeholder tokens with other pixels must not reuse the blocks).

The property test needs no torch: a fake model whose "KV" at each position is a hash of the KV at
the previous position (read through the block table), the token and the image content there, and
whose sampled token is a function of the last position's KV. A wrong reuse of a block (another
prefix, another image, a block not yet written) changes its outputs, which must equal a reference
computed from the token sequence alone.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.request import IMAGE_PATCH_PIXELS, ImageInput, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, StepPlan
from engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ATOL = 1e-5  # fp32 on CPU; the same chunk layout gives the same values up to summation order


def _text(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _image(h: int, w: int, seed: int) -> ImageInput:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return ImageInput(pixels, hashlib.sha256(pixels.tobytes()).hexdigest())


def _run(
    engine: LLMEngine, prompt: list[int], images: list[ImageInput] | None = None
) -> tuple[list[int], torch.Tensor, int]:
    """Greedy tokens, the logits behind each of them ([tokens, vocab]) and the cached count."""
    engine.runner.keep_logits = True
    engine.runner.kept_logits.clear()
    rid = engine.add_request(prompt, GREEDY, images=images)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            assert out.request_id == rid
            tokens.extend(out.new_token_ids)
            if out.finished:
                cached = out.num_cached_tokens
    logits = torch.stack(engine.runner.kept_logits[rid])
    assert logits.shape == (GREEDY.max_tokens, engine.arch.vocab_size)
    assert len(tokens) == GREEDY.max_tokens and cached >= 0
    return tokens, logits, cached


@pytest.fixture(params=["chunked", "unchunked"])
def engines(
    make_engine: Callable[..., LLMEngine], request: pytest.FixtureRequest
) -> tuple[LLMEngine, LLMEngine]:
    """(warm: prefix caching on, cold: off), same weights, same budget and policy."""
    kw = {"token_budget": 128, "policy": request.param}
    warm = make_engine(enable_prefix_caching=True, **kw)
    cold = make_engine(enable_prefix_caching=False, **kw)
    assert warm.block_manager.block_size == 16
    return warm, cold


def _assert_same_as_cold(
    warm: LLMEngine,
    cold: LLMEngine,
    prompt: list[int],
    images: list[ImageInput] | None = None,
) -> tuple[int, torch.Tensor]:
    tokens, logits, cached = _run(warm, prompt, images)
    ref_tokens, ref_logits, ref_cached = _run(cold, prompt, images)
    assert ref_cached == 0
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert tokens == ref_tokens
    return cached, logits


def test_whole_prompt_hit_same_logits(engines: tuple[LLMEngine, LLMEngine]) -> None:
    warm, cold = engines
    prompt = _text(300, 3)
    cached, _ = _assert_same_as_cold(warm, cold, prompt)
    assert cached == 0  # the first run fills the cache
    cached, _ = _assert_same_as_cold(warm, cold, prompt)
    assert cached == 288  # 18 full blocks of 16; the last 12 tokens are computed


def test_hit_ending_mid_block_same_logits(engines: tuple[LLMEngine, LLMEngine]) -> None:
    warm, cold = engines
    base = _text(300, 4)
    _assert_same_as_cold(warm, cold, base)
    # diverges at 250, inside block 15 (240..255): blocks 0-14 are hits, block 15 is recomputed
    cached, _ = _assert_same_as_cold(warm, cold, base[:250] + _text(90, 5))
    assert cached == 240
    # a prompt that is a strict prefix of a cached one, ending mid-block
    cached, _ = _assert_same_as_cold(warm, cold, base[:170])
    assert cached == 160
    # a cached prompt that ended mid-block (170 = 10 blocks + 10): its block 10 was filled by its
    # own output tokens, so a longer prompt with other tokens there reuses 10 blocks only
    short = _text(170, 13)
    _assert_same_as_cold(warm, cold, short)
    cached, _ = _assert_same_as_cold(warm, cold, short + _text(30, 14))
    assert cached == 160


def test_hit_over_decode_written_blocks_same_logits(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """A follow-up turn whose prompt is the first prompt plus its output: the blocks that decode
    steps filled are reused."""
    warm, cold = engines
    first = _text(27, 6)  # 27 + 8 outputs = 35 tokens: blocks 0 and 1 are full after decoding
    tokens, _, _ = _run(warm, first)
    follow = first + tokens + _text(40, 7)
    cached, _ = _assert_same_as_cold(warm, cold, follow)
    assert cached == 32


def test_image_hash_is_part_of_the_block_hash(engines: tuple[LLMEngine, LLMEngine]) -> None:
    warm, cold = engines
    tok = warm.tokenizer
    assert tok.image_token_id is not None and warm.vision is not None
    img_a, img_b = _image(112, 84, 1), _image(112, 84, 2)  # 12 image tokens each
    assert img_a.num_tokens == img_b.num_tokens == 12 and img_a.content_hash != img_b.content_hash
    # text 0..19, image 20..31 (inside block 1), text 32..99
    prompt = _text(20, 8) + [tok.image_token_id] * 12 + _text(68, 9)
    cached, logits_a = _assert_same_as_cold(warm, cold, prompt, [img_a])
    assert cached == 0
    # the same image again: the blocks covering it are hits (6 full blocks of 16)
    cached, again = _assert_same_as_cold(warm, cold, prompt, [img_a])
    assert cached == 96
    torch.testing.assert_close(again, logits_a, atol=ATOL, rtol=0)
    # other pixels, same placeholder tokens: only block 0 (text before the image) may be reused
    cached, logits_b = _assert_same_as_cold(warm, cold, prompt, [img_b])
    assert cached == 16
    assert not torch.allclose(logits_b, logits_a, atol=1e-3)  # the image matters


def test_hit_covering_part_of_an_image_span(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """The hit ends inside an image span: the rest of the image's embeddings are still used."""
    warm, cold = engines
    image_id = warm.tokenizer.image_token_id
    assert image_id is not None
    img = _image(168, 84, 3)  # 18 image tokens at 10..27: blocks 0 and 1
    prompt = _text(10, 10) + [image_id] * 18 + _text(30, 11)
    _assert_same_as_cold(warm, cold, prompt, [img])
    # same text and image, other text from position 28: block 0 is a hit (positions 0..15,
    # image tokens 10..15), block 1 is recomputed with the image's tokens 16..27
    other = _text(10, 10) + [image_id] * 18 + _text(30, 12)
    cached, _ = _assert_same_as_cold(warm, cold, other, [img])
    assert cached == 16


# --- property test: no model, a fake one that reads its "KV" through the block table -----------
BLOCK = 4
IMAGE_ID = 300
M = (1 << 61) - 1


class _Pixels:
    """Stands in for an image array: only its shape is read (for the token count)."""

    def __init__(self, num_tokens: int) -> None:
        self.shape = (IMAGE_PATCH_PIXELS * num_tokens, IMAGE_PATCH_PIXELS, 3)


IMAGES = {k: ImageInput(_Pixels(6), f"image-{k}") for k in ("a", "b")}


def _mix(prev: int, token: int, image_key: str | None) -> int:
    extra = zlib.crc32(image_key.encode()) if image_key is not None else 0
    return (prev * 1_000_003 + token * 7919 + extra + 1) % M


def _image_key(req: Request, pos: int) -> str | None:
    """What an image contributes at a position: its content and the offset inside it."""
    for img, (start, n) in zip(req.images, req.image_spans, strict=True):
        if start <= pos < start + n:
            return f"{img.content_hash}/{pos - start}"
    return None


class FakeKVModel:
    """Each position's KV = mix(KV of the previous position, token, image content). Reads go
    through the request's block table, so a block reused by mistake shows up in the outputs."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.kv: list[list[int | None]] = [[None] * bm.block_size for _ in range(bm.num_blocks)]

    def _slot(self, req: Request, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // self.bm.block_size], pos % self.bm.block_size

    def execute(self, plan: StepPlan) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in plan.chunks:
            req = c.request
            for pos in range(c.start, c.start + c.num_tokens):
                prev = 0
                if pos > 0:
                    b, i = self._slot(req, pos - 1)
                    val = self.kv[b][i]
                    assert val is not None, f"{req.request_id} reads an unwritten slot at {pos - 1}"
                    prev = val
                b, i = self._slot(req, pos)
                # never write into a block another request holds
                assert self.bm.ref_counts[b] == 1, f"write into shared block {b}"
                self.kv[b][i] = _mix(prev, req.token_ids[pos], _image_key(req, pos))
            if c.produces_token:
                b, i = self._slot(req, c.start + c.num_tokens - 1)
                out[c.request_id] = self.kv[b][i] % 251  # type: ignore[operator]
        return out


def _reference(req: Request, max_tokens: int) -> list[int]:
    """The outputs computed from the token sequence alone (no cache, no blocks)."""
    tokens = list(req.token_ids[: req.num_prompt_tokens])
    val = 0
    for pos, t in enumerate(tokens):
        val = _mix(val, t, _image_key(req, pos))
    outs = []
    for _ in range(max_tokens):
        nxt = val % 251
        outs.append(nxt)
        val = _mix(val, nxt, None)
    return outs


arrival = st.tuples(
    st.integers(0, 20),  # step at which it arrives
    st.integers(0, 3),  # shared text prefix (0: none)
    st.sampled_from([None, "a", "b"]),  # image after the prefix
    st.integers(1, 30),  # own text length
    st.integers(1, 6),  # max tokens
)


def _simulate(arrivals, blocks: int, budget: int, policy: str, caching: bool):  # type: ignore[no-untyped-def]
    bm = BlockManager(blocks, BLOCK, caching)
    s = Scheduler(bm, token_budget=budget, max_token_budget=4096, policy=policy)
    model = FakeKVModel(bm)
    # prefixes of repeated tokens: equal blocks at different places differ only by their parent
    prefixes = {k: [100 + k] * (3 * k + 2 * (k > 1)) for k in range(4)}
    pending = []
    for i, (step, pre, img, length, mt) in enumerate(arrivals):
        prompt = prefixes[pre] + ([IMAGE_ID] * 6 if img else []) + [50] * length
        if len(prompt) + mt <= blocks * BLOCK:
            pending.append((step, i, prompt, img, mt))
    pending.sort(key=lambda p: (p[0], p[1]))
    reqs: dict[str, tuple[Request, int]] = {}
    computed: dict[str, int] = {}  # positions computed or reused so far, per request
    hits = prefill = 0
    for step in range(3000):
        while pending and pending[0][0] <= step:
            _, i, prompt, img, mt = pending.pop(0)
            r = Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=mt, ignore_eos=True),
                arrival_ns=0,
                images=[IMAGES[img]] if img else None,
                image_token_id=IMAGE_ID,
            )
            reqs[r.request_id] = (r, mt)
            s.add(r)
        if not s.has_unfinished() and not pending:
            break
        plan = s.schedule()
        prefill += plan.num_prefill_tokens
        for r in plan.preempted:
            computed[r.request_id] = 0
        for c in plan.chunks:
            skipped = c.start - computed.get(c.request_id, 0)
            assert skipped >= 0 and (skipped == 0 or caching)
            hits += skipped  # a prefix-cache hit skips ahead
            computed[c.request_id] = c.start + c.num_tokens
        sampled = model.execute(plan)
        s.update(plan, sampled, step)
    else:
        raise AssertionError("simulation did not finish")
    for r, mt in reqs.values():
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == _reference(r, mt), r.request_id
    assert bm.num_used_blocks == 0 and all(c == 0 for c in bm.ref_counts)
    return hits, prefill


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=10),
    blocks=st.integers(12, 40),
    budget=st.integers(1, 24),
    policy=st.sampled_from(["chunked", "unchunked"]),
)
# one image, then the same placeholders with another image, then the first again
@example([(0, 2, "a", 9, 3), (5, 2, "b", 9, 3), (9, 2, "a", 9, 3)], 40, 16, "chunked")
# equal blocks of repeated tokens behind different prefixes
@example([(0, 0, None, 20, 2), (6, 3, None, 20, 2), (9, 1, None, 20, 2)], 40, 8, "chunked")
def test_cached_outputs_follow_the_kv_contents(arrivals, blocks, budget, policy) -> None:  # type: ignore[no-untyped-def]
    # both runs check every output against the reference; preemptions differ between them, so
    # the number of prefill tokens computed is not compared
    hits_off, _ = _simulate(arrivals, blocks, budget, policy, caching=False)
    _simulate(arrivals, blocks, budget, policy, caching=True)
    assert hits_off == 0


def test_property_examples_do_hit_the_cache() -> None:
    """The explicit examples above exercise reuse (else the property would pass vacuously)."""
    hits, _ = _simulate(
        [(0, 2, "a", 9, 3), (5, 2, "b", 9, 3), (9, 2, "a", 9, 3)], 40, 16, "chunked", True
    )
    # request 2 (image b) may reuse only the 8-token text prefix; request 3 reuses image a's
    assert hits == 8 + 20


def test_preempted_requests_with_cache_hits_same_logits(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A cache too small for the batch: requests are preempted and recomputed, reusing cached
    blocks (their own, and the shared prefix). Every logit row equals a cold, roomy run's."""
    prefix = _text(40, 20)
    prompts = [prefix + _text(20 + 7 * i, 21 + i) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    warm = make_engine(token_budget=64, num_kv_blocks=14, enable_prefix_caching=True)
    cold = make_engine(token_budget=64, enable_prefix_caching=False)

    def run(engine: LLMEngine) -> tuple[dict[str, torch.Tensor], int, int]:
        engine.runner.keep_logits = True
        engine.runner.kept_logits.clear()
        ids = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        preempted = cached = 0
        while engine.has_unfinished_requests():
            res = engine.step()
            if res.event is not None:
                preempted += res.event.num_preemptions
            cached += sum(o.num_cached_tokens for o in res.outputs if o.finished)
        kept = {i: torch.stack(engine.runner.kept_logits[i]) for i in ids}
        assert all(k.shape[0] == params.max_tokens for k in kept.values())
        return kept, preempted, cached

    got, preempted, cached = run(warm)
    ref, ref_preempted, _ = run(cold)
    assert preempted > 0 and ref_preempted == 0  # the small cache forces recomputation
    assert cached >= 32  # the shared prefix (2 blocks) was reused at least once
    for rid, logits in ref.items():
        torch.testing.assert_close(got[rid], logits, atol=1e-4, rtol=0, msg=rid)
