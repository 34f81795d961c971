"""The split backend (CPU default) computes what SDPA computes, over the same paged cache.

Backend level: the flex tests' hand-built layouts (shuffled physical blocks, GQA, shared prefix
blocks, mixed prefill + decode steps) plus long contexts over many blocks, chunk offsets off
the block grid, a GQA group of 4, and consecutive blocks (the prefix read as a view), in fp32
(atol 1e-5 against ``SdpaBackend``) and bf16 (within bf16's own noise, as ``gpu_check.py``
measures it: the bf16 reference against the fp32 one). Engine level: greedy tokens and kept
logits of a split engine equal an SDPA engine's, fp32 and bf16. Then selection and fallback.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

import engine.model.attention.split as sp
from engine.core.config import EngineConfig
from engine.model.attention.common import SeqSlice
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.select import select_backend
from engine.model.attention.split import SplitBackend, SplitMetadata, merge
from tests.engine.model.test_attention_flex import CASES as FLEX_CASES
from tests.engine.model.test_attention_flex import GREEDY, LLMEngine

CPU = torch.device("cpu")
ATOL = 1e-5


@dataclass
class Case:
    name: str
    seqs: list[tuple[int, int, str]]  # (q_len, ctx_len, block group); same group = shared blocks
    block_size: int = 16
    head_dim: int = 32
    heads: tuple[int, int] = (4, 2)  # query heads, K/V heads
    consecutive: bool = False  # blocks handed out in order (the prefix is one run)


CASES = [Case(c.name, c.seqs, c.block_size, c.head_dim) for c in FLEX_CASES] + [
    Case("long context, many blocks", [(64, 1500, "a"), (1, 700, "b"), (1, 650, "c")]),
    Case("offset off the block grid, GQA 4", [(37, 1003, "a"), (3, 29, "b")], heads=(8, 2)),
    Case("no GQA", [(50, 130, "a"), (1, 40, "b")], heads=(2, 2)),
    Case("consecutive blocks", [(100, 517, "a"), (1, 90, "b")], consecutive=True),
    Case("consecutive, block size 7", [(19, 200, "a"), (40, 40, "b")], 7, consecutive=True),
]


def _num_blocks(case: Case) -> int:
    return sum(-(-ctx // case.block_size) for _, ctx, _ in case.seqs) + 7


def _layout(case: Case, num_blocks: int, seed: int = 0) -> list[SeqSlice]:
    """Sequences whose blocks are scattered over the cache (or handed out in order); a group's
    sequences share blocks by logical index (prefix caching)."""
    bs = case.block_size
    free = list(range(num_blocks))[::-1]
    if not case.consecutive:
        random.Random(seed).shuffle(free)
    groups: dict[str, list[int]] = {}
    seqs, q0 = [], 0
    for q_len, ctx, group in case.seqs:
        ids = groups.setdefault(group, [])
        need = -(-ctx // bs)
        if group == "p":  # shared prefix of 3 blocks, then a private tail
            if not ids:
                ids.extend(free.pop() for _ in range(3))
            blocks = ids[:need] + [free.pop() for _ in range(need - min(need, 3))]
        else:
            ids.extend(free.pop() for _ in range(need - len(ids)))
            blocks = ids[:need]
        seqs.append(SeqSlice(q0, q_len, ctx, blocks))
        q0 += q_len
    return seqs


def _inputs(case: Case, seqs: list[SeqSlice], num_blocks: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hq, hkv = case.heads
    t, d, bs = sum(s.q_len for s in seqs), case.head_dim, case.block_size
    cache = [torch.randn(num_blocks, bs, hkv, d, generator=g) for _ in range(2)]
    qkv = (
        torch.randn(t, hq, d, generator=g),
        torch.randn(t, hkv, d, generator=g),
        torch.randn(t, hkv, d, generator=g),
    )
    return cache, qkv


def _forward(backend, case: Case, seqs, cache, qkv, dtype=torch.float32) -> torch.Tensor:
    k_cache, v_cache = (c.to(dtype, copy=True) for c in cache)
    qkv = tuple(t.to(dtype) for t in qkv)
    meta = backend.prepare_metadata(seqs, case.block_size, CPU)
    with torch.inference_mode():
        out = backend.forward(*qkv, k_cache, v_cache, meta)
        again = backend.forward(*qkv, k_cache, v_cache, meta)  # second layer, same metadata
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    assert out.dtype == dtype
    return out.float()


def _setup(case: Case):
    nb = _num_blocks(case)
    seqs = _layout(case, nb)
    return seqs, *_inputs(case, seqs, nb)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_split_equals_sdpa_fp32(case: Case) -> None:
    seqs, cache, qkv = _setup(case)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    got = _forward(SplitBackend(), case, seqs, cache, qkv)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_split_bf16_within_bf16_noise(case: Case) -> None:
    """bf16's own noise is what the SDPA reference moves by going from fp32 to bf16 (the rule of
    ``gpu_check.py``). Two roundings to bf16 (each part's output, then the merge) can add one
    ulp to the reference's one: the max error may reach twice the noise, the mean may not
    exceed it by more than a quarter."""
    seqs, cache, qkv = _setup(case)
    ref32 = _forward(SdpaBackend(), case, seqs, cache, qkv)
    ref16 = _forward(SdpaBackend(), case, seqs, cache, qkv, torch.bfloat16)
    got = _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)
    noise = (ref16 - ref32).abs()
    err = (got - ref32).abs()
    assert float(err.max()) <= 2 * float(noise.max())
    assert float(err.mean()) <= 1.25 * float(noise.mean())


def test_prefix_is_read_in_place_when_blocks_are_consecutive() -> None:
    case = next(c for c in CASES if c.name == "consecutive blocks")
    seqs, _, _ = _setup(case)
    meta = SplitBackend().prepare_metadata(seqs, case.block_size, CPU).torch_parts()
    assert isinstance(meta, SplitMetadata)
    (p,) = meta.split_prefills
    first = seqs[0].block_ids[0] * case.block_size
    assert p.prefix_range == (first, first + 517 - 100) and p.prefix_slots is None
    scattered = next(c for c in CASES if c.name == "long context, many blocks")
    seqs, _, _ = _setup(scattered)
    (p,) = SplitBackend().prepare_metadata(seqs, 16, CPU).torch_parts().split_prefills
    assert p.prefix_range is None and p.prefix_slots is not None
    assert p.prefix_slots.shape == (1500 - 64,)


def test_merge_of_two_key_sets_is_softmax_over_their_union() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 5, 8, generator=g) for _ in range(3))
    k2, v2 = torch.randn(3, 7, 8, generator=g), torch.randn(3, 7, 8, generator=g)

    def part(kk: torch.Tensor, vv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = q @ kk.transpose(1, 2)
        return s.softmax(-1) @ vv, s.logsumexp(-1)

    whole = (q @ torch.cat([k, k2], 1).transpose(1, 2)).softmax(-1) @ torch.cat([v, v2], 1)
    torch.testing.assert_close(merge(*part(k, v), *part(k2, v2)), whole, atol=1e-6, rtol=0)


# --- planted bugs ---------------------------------------------------------------------------------
def _merge_without_lse(o1, lse1, o2, lse2):  # type: ignore[no-untyped-def]
    return (o1.float() + o2.float()) / 2


@pytest.mark.parametrize("bug", ["merge ignores log-sum-exp", "prefix one slot short"])
def test_planted_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.name == "consecutive blocks")
    seqs, cache, qkv = _setup(case)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    if bug == "merge ignores log-sum-exp":
        monkeypatch.setattr(sp, "merge", _merge_without_lse)
    else:
        real = sp.prefix_location

        def short(s, bs, row):  # type: ignore[no-untyped-def]
            rng, slots = real(s, bs, row)
            return (rng[0], rng[1] - 1) if rng else None, slots

        monkeypatch.setattr(sp, "prefix_location", short)
    got = _forward(SplitBackend(), case, seqs, cache, qkv)
    assert (got - ref).abs().max() > 1e-3


# --- engine level ---------------------------------------------------------------------------------
def _engine_run(backend: str, dtype: str, budget: int) -> dict[str, tuple[list[int], torch.Tensor]]:
    """A chunked prompt at offsets off the block grid, a short one, and a third that arrives
    mid-run with a prefix-cache hit, so steps mix prefill chunks and decodes."""
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            dtype=dtype,
            attention_backend=backend,
            token_budget=budget,
            max_token_budget=256,
            num_kv_blocks=96,
        )
    )
    assert engine.runner.backend.name == backend
    engine.runner.keep_logits = True
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(70)]
    prompts = {
        "a": shared + [rng.randrange(256) for _ in range(290)],
        "b": [rng.randrange(256) for _ in range(37)],
    }
    tokens: dict[str, list[int]] = {}
    rids = {name: engine.add_request(p, GREEDY) for name, p in prompts.items()}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:
            rids["c"] = engine.add_request(shared + [7, 8, 9], GREEDY)
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    kept = engine.runner.kept_logits
    return {n: (tokens[r], torch.stack(kept[r])) for n, r in rids.items()}


def test_engine_split_equals_sdpa_fp32() -> None:
    ref = _engine_run("sdpa", "float32", 45)
    got = _engine_run("split", "float32", 45)
    assert got.keys() == ref.keys() == {"a", "b", "c"}
    for name in ref:
        assert got[name][0] == ref[name][0], name
        torch.testing.assert_close(got[name][1], ref[name][1], atol=ATOL, rtol=0)


def test_engine_split_bf16_within_bf16_noise() -> None:
    """``gpu_check.py``'s rule: the candidate's logits differ from the bf16 reference's by no
    more than bf16 moves the reference (bf16 against fp32), and the tokens are equal. The logits
    are bf16 values, so two bf16 runs that differ at all differ by at least one ulp at the
    logits' magnitude (SDPA's own chunked run against its one-shot run does: 0.0625 where the
    noise is 0.052): the bound is the noise plus that ulp."""
    ref32 = _engine_run("sdpa", "float32", 45)
    ref16 = _engine_run("sdpa", "bfloat16", 45)
    got = _engine_run("split", "bfloat16", 45)
    for name in ref16:
        noise = float((ref16[name][1] - ref32[name][1]).abs().max())
        ulp = 2.0 ** (math.floor(math.log2(float(ref16[name][1].abs().max()))) - 7)
        err = float((got[name][1] - ref16[name][1]).abs().max())
        assert err <= noise + ulp, (name, err, noise, ulp)
        assert got[name][0] == ref16[name][0], name


# --- selection ------------------------------------------------------------------------------------
def test_select_split(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_backend("auto", CPU, 16).name == "split"
    assert select_backend("split", CPU, 5).name == "split"
    assert select_backend("sdpa", CPU, 16).name == "sdpa"
    with pytest.raises(ValueError, match="CPU only"):
        select_backend("split", torch.device("cuda"), 16)
    assert EngineConfig(attention_backend="split").validate().attention_backend == "split"
    from engine.server.cli import build_parser

    assert build_parser().parse_args(["--attention-backend", "split"]).attention_backend == "split"
    monkeypatch.setattr(sp, "_flash_op", lambda: None)  # a torch without the kernel
    assert select_backend("auto", CPU, 16).name == "sdpa"
    with pytest.raises(RuntimeError, match="--attention-backend sdpa"):
        select_backend("split", CPU, 16)
