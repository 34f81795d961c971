"""The flex attention backend computes what SDPA computes, over the same paged cache.

Backend level: hand-built layouts (shuffled physical blocks, GQA, random cache contents around
the sequences' blocks) against ``SdpaBackend``; the block lists against the dense mask (every kept
score is in a listed block, "full" blocks are wholly kept, no listed block is wholly masked);
planted mask bugs that the comparisons must catch. Engine level: greedy tokens and kept logits of
a flex engine equal an SDPA engine's. Then configuration errors, and the shape bucketing that
keeps compiled flex from recompiling (counted with a Dynamo backend that compiles nothing).

These run eager flex on CPU. ``CHUNKSCOPE_FLEX_COMPILE=1`` runs every FlexBackend of the file
through Inductor's C++ flex kernel instead (~70 s of compiling on 2 cores, cold). With CUDA, the
last test runs the compiled Triton path against CUDA SDPA (block sizes 16 and 128).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import engine.model.attention.flex as af
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.attention.common import SeqSlice
from engine.model.attention.flex import FlexBackend, bucket, kernel_options_for
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.select import select_backend

CPU = torch.device("cpu")
HQ, HKV = 4, 2
ATOL = 1e-5

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def _restore_dynamo_limit() -> Iterator[None]:
    """Compiled backends raise Dynamo's recompile limit (a global); undo it after each test."""
    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = limit


# --- hand-built layouts ---------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    seqs: list[tuple[int, int, str]]  # (q_len, ctx_len, block group); same group = shared blocks
    block_size: int = 16
    head_dim: int = 32


CASES = [
    Case("one-shot prefill", [(100, 100, "a")]),
    Case("chunk at an offset", [(50, 130, "a")]),
    Case("chunk over 128, not a multiple", [(200, 230, "a")], head_dim=16),
    Case("chunk of 129 at an offset", [(129, 300, "a")], block_size=32, head_dim=64),
    Case("decodes, partial last blocks", [(1, 33, "a"), (1, 16, "b"), (1, 100, "c"), (1, 1, "d")]),
    Case("mixed step", [(70, 90, "a"), (1, 33, "b"), (2, 17, "c"), (1, 48, "d")]),
    Case("shared prefix blocks", [(20, 70, "p"), (1, 60, "p"), (30, 90, "p")]),
    Case("block size 5 (CPU eager)", [(40, 77, "a"), (1, 23, "b")], block_size=5),
]


def _layout(case: Case, num_blocks: int, seed: int = 0) -> list[SeqSlice]:
    """Sequences whose blocks are scattered over the cache; a group's sequences share blocks by
    logical index (prefix caching), the longest one owning the most."""
    bs = case.block_size
    free = list(range(num_blocks))
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
    t, d, bs = sum(s.q_len for s in seqs), case.head_dim, case.block_size
    cache = [torch.randn(num_blocks, bs, HKV, d, generator=g) for _ in range(2)]
    qkv = (
        torch.randn(t, HQ, d, generator=g),
        torch.randn(t, HKV, d, generator=g),
        torch.randn(t, HKV, d, generator=g),
    )
    return cache, qkv


def _forward(backend, case: Case, seqs, cache, qkv, device: torch.device = CPU) -> torch.Tensor:
    k_cache, v_cache = (c.to(device, copy=True) for c in cache)
    qkv = tuple(t.to(device) for t in qkv)
    meta = backend.prepare_metadata(seqs, case.block_size, device)
    with torch.inference_mode():
        out = backend.forward(*qkv, k_cache, v_cache, meta)
        again = backend.forward(*qkv, k_cache, v_cache, meta)  # second layer, same metadata
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    return out.cpu()


def _num_blocks(case: Case) -> int:
    return sum(-(-ctx // case.block_size) for _, ctx, _ in case.seqs) + 7  # + unused blocks


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_flex_equals_sdpa(case: Case) -> None:
    nb = _num_blocks(case)
    seqs = _layout(case, nb)
    cache, qkv = _inputs(case, seqs, nb)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    got = _forward(FlexBackend(), case, seqs, cache, qkv)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _dense_truth(call) -> torch.Tensor:
    """The call's mask_mod evaluated on every (row, query, slot): [B, Q, num_slots]."""
    bm = call.block_mask
    q_len, kv_len = bm.seq_lengths
    return create_mask(bm.mask_mod, bm.shape[0], 1, q_len, kv_len, device="cpu")[:, 0]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_block_lists_cover_exactly_the_mask(case: Case) -> None:
    """What compiled kernels rely on (eager flex ignores the lists): every kept score lies in a
    listed block, "full" blocks are kept whole (their mask is never evaluated), and no listed
    block is wholly masked for the real query rows (pages limited to the causal reach)."""
    nb, bs = _num_blocks(case), case.block_size
    seqs = _layout(case, nb)
    meta = FlexBackend().prepare_metadata(seqs, bs, CPU)
    FlexBackend()._finish(meta, nb, CPU)
    calls = [(p, p.q_len, 1) for p in meta.flex_prefills]
    if meta.flex_decode is not None:
        calls.append((meta.flex_decode, 1, meta.flex_decode.rows.numel()))
    assert calls
    for call, real_q, real_b in calls:
        bm = call.block_mask
        truth = _dense_truth(call)  # [B, Q, slots]
        rows, q_len = truth.shape[0], truth.shape[1]
        qb = af.Q_BLOCK
        # [B, R, Q_BLOCK, num_blocks, bs]
        r = -(-q_len // qb)
        t = torch.nn.functional.pad(truth, (0, 0, 0, r * qb - q_len)).view(rows, r, qb, nb, bs)
        real = torch.zeros(rows, r * qb, dtype=torch.bool)
        real[:real_b, :real_q] = True
        real = real.view(rows, r, qb)
        for b in range(rows):
            for i in range(r):
                full = bm.full_kv_indices[b, 0, i, : bm.full_kv_num_blocks[b, 0, i]].tolist()
                diag = bm.kv_indices[b, 0, i, : bm.kv_num_blocks[b, 0, i]].tolist()
                assert not set(full) & set(diag) and len(set(full + diag)) == len(full + diag)
                tr = t[b, i][real[b, i]]  # [real rows, nb, bs]
                kept_blocks = set(torch.nonzero(tr.any(dim=(0, 2))).flatten().tolist())
                assert kept_blocks <= set(full) | set(diag), (b, i)
                for blk in full:  # every query row of the call, padding rows too
                    rows_i = t[b, i, : min(qb, q_len - i * qb), blk]
                    assert bool(rows_i.all()), ("full block not full", b, i, blk)
                for blk in diag:
                    assert bool(tr[:, blk].any()), ("listed block wholly masked", b, i, blk)
                if not real[b, i].any():
                    assert not full and not diag


# --- planted bugs ---------------------------------------------------------------------------------
def _bad_mask(kind: str):
    def factory(page_logical, table, q_base, block_size):
        def mask_mod(b, h, q_idx, kv_idx):
            block = kv_idx // block_size
            logical = page_logical[block]
            owned = table[b, logical] == block
            pos = logical * block_size + kv_idx % block_size
            if kind == "no offset":
                return owned & (pos <= q_idx)
            if kind == "off by one":
                return owned & (pos < q_base[b] + q_idx)
            return pos <= q_base[b] + q_idx  # "no ownership"

        return mask_mod

    return factory


@pytest.mark.parametrize("bug", ["no offset", "off by one", "no ownership"])
def test_planted_mask_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = next(c for c in CASES if c.name == "mixed step")  # offset chunk + decodes
    nb = _num_blocks(case)
    seqs = _layout(case, nb)
    cache, qkv = _inputs(case, seqs, nb)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    monkeypatch.setattr(af, "paged_causal_mask", _bad_mask(bug))
    # Eager: it applies mask_mod to every slot (compiled kernels visit only the listed blocks,
    # all owned by the row's sequence, so they never see the "no ownership" bug).
    got = _forward(FlexBackend(compile=False), case, seqs, cache, qkv)
    assert (got - ref).abs().max() > 1e-2


def test_shared_block_at_two_logical_positions_is_refused() -> None:
    seqs = [SeqSlice(0, 1, 40, [3, 4, 5]), SeqSlice(1, 1, 40, [4, 3, 6])]
    with pytest.raises(RuntimeError, match="different logical positions"):
        FlexBackend().prepare_metadata(seqs, 16, CPU)


# --- engine level ---------------------------------------------------------------------------------
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine_run(backend: str, block_size: int) -> dict[str, tuple[list[int], torch.Tensor]]:
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            attention_backend=backend,
            block_size=block_size,
            token_budget=48,
            max_token_budget=256,
            num_kv_blocks=96,
        )
    )
    assert engine.runner.backend.name == backend
    engine.runner.keep_logits = True
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(70)]
    prompts = {
        "a": shared + [rng.randrange(256) for _ in range(90)],  # chunked, offsets > 0
        "b": [rng.randrange(256) for _ in range(37)],
    }
    tokens: dict[str, list[int]] = {}
    rids = {name: engine.add_request(p, GREEDY) for name, p in prompts.items()}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:  # arrives mid-run: prefix-cache hit on a's first blocks, mixed steps
            rids["c"] = engine.add_request(shared + [7, 8, 9], GREEDY)
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == rids.get("c"):
                assert out.num_cached_tokens == 64  # c reads a's blocks while a decodes
    kept = engine.runner.kept_logits
    return {n: (tokens[r], torch.stack(kept[r])) for n, r in rids.items()}


@pytest.mark.parametrize("block_size", [16, 32])
def test_engine_flex_equals_sdpa(block_size: int) -> None:
    ref = _engine_run("sdpa", block_size)
    got = _engine_run("flex", block_size)
    assert got.keys() == ref.keys() == {"a", "b", "c"}
    for name in ref:
        assert got[name][0] == ref[name][0], name
        torch.testing.assert_close(got[name][1], ref[name][1], atol=ATOL, rtol=0)


# --- configuration --------------------------------------------------------------------------------
def test_config_and_cli_accept_flex() -> None:
    assert EngineConfig(attention_backend="flex").validate().attention_backend == "flex"
    with pytest.raises(ValueError, match="auto, sdpa, flash, flex or split"):
        EngineConfig(attention_backend="flexx").validate()
    from engine.server.cli import build_parser

    args = build_parser().parse_args(["--attention-backend", "flex"])
    assert args.attention_backend == "flex"


def test_select_backend_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(af.FLEX_COMPILE_ENV, raising=False)
    cuda = torch.device("cuda")  # constructible without a GPU; nothing runs on it
    with pytest.raises(ValueError, match="block_size % 16 == 0"):
        select_backend("flex", cuda, 24)
    gpu = select_backend("flex", cuda, 128)
    assert gpu.name == "flex" and gpu.compiled and not gpu.dense_widths
    assert torch._dynamo.config.recompile_limit >= af.MIN_RECOMPILE_LIMIT
    cpu = select_backend("flex", CPU, 5)
    assert cpu.name == "flex" and not cpu.compiled
    monkeypatch.setenv(af.FLEX_COMPILE_ENV, "1")
    assert select_backend("flex", CPU, 16).dense_widths
    assert select_backend("auto", CPU, 16).name == "split"  # auto on CPU: the split backend
    with pytest.raises(ValueError, match="block_size % 16 == 0"):
        FlexBackend().prepare_metadata([SeqSlice(0, 1, 3, [0])], 8, cuda)
    assert kernel_options_for(cuda, 256) is None
    assert kernel_options_for(cuda, 16) == {"BLOCK_N": 16}
    assert kernel_options_for(cuda, 48) == {"BLOCK_N": 16}
    assert kernel_options_for(cuda, 64) == {"BLOCK_N": 64}
    assert kernel_options_for(CPU, 16) is None


# --- compiled shapes ------------------------------------------------------------------------------
def test_buckets_bound_the_compiled_graphs() -> None:
    """Compiled mode through a Dynamo backend that counts graphs and runs them as traced: decode
    batches 1..8, contexts growing over several width buckets and prefill chunks of 2..128 rows
    share one decode and one prefill graph; a 9th decode and a 129-row chunk add one each."""
    graphs = {"n": 0}

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs["n"] += 1
        return gm.forward

    backend = FlexBackend(compile=True, compile_backend=counting)
    assert not backend.dense_widths
    torch._dynamo.reset()

    def step(specs: list[tuple[int, int]]) -> None:
        c = Case("", [(q, ctx, str(i)) for i, (q, ctx) in enumerate(specs)], 8, 16)
        nb = 400
        seqs = _layout(c, nb, seed=len(specs))
        cache, qkv = _inputs(c, seqs, nb)
        ref = _forward(SdpaBackend(), c, seqs, cache, qkv)
        torch.testing.assert_close(_forward(backend, c, seqs, cache, qkv), ref, atol=ATOL, rtol=0)

    for n in range(1, 9):
        step([(1, 5 + 40 * n)] * n)  # widths 8 .. 64
    for q in (2, 50, 128):
        step([(q, q + 300)])  # prefill widths up to 64 blocks of 8
    assert graphs["n"] == 2, graphs
    step([(1, 20)] * 9)
    step([(129, 140)])
    assert graphs["n"] == 4, graphs


def test_bucket() -> None:
    assert [bucket(n, 8) for n in (0, 1, 8, 9, 200)] == [8, 8, 8, 16, 256]
    assert bucket(129, 128) == 256


@pytest.mark.skipif(
    os.environ.get(af.FLEX_COMPILE_ENV) != "1", reason="set CHUNKSCOPE_FLEX_COMPILE=1 (slow)"
)
@pytest.mark.slow
def test_inductor_cpu_flex_equals_sdpa() -> None:
    backend = FlexBackend(compile=True)
    assert backend.dense_widths
    for case in CASES:
        if case.block_size != 16:
            continue
        nb = _num_blocks(case)
        seqs = _layout(case, nb)
        cache, qkv = _inputs(case, seqs, nb)
        ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
        got = _forward(backend, case, seqs, cache, qkv)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_size", [16, 128])
def test_cuda_compiled_flex_equals_sdpa(block_size: int) -> None:
    """The Triton path (compiled; BLOCK_N override at 16) against CUDA SDPA in fp32."""
    cuda = torch.device("cuda")
    backend = select_backend("flex", cuda, block_size)
    assert backend.compiled
    for case in CASES:
        if case.block_size == 5:
            continue
        case = Case(case.name, case.seqs, block_size, case.head_dim)
        nb = _num_blocks(case)
        seqs = _layout(case, nb)
        cache, qkv = _inputs(case, seqs, nb)
        ref = _forward(SdpaBackend(), case, seqs, cache, qkv, cuda)
        got = _forward(backend, case, seqs, cache, qkv, cuda)
        # loose enough for TF32 dots; mask bugs are off by > 1e-2 (the planted-bug test)
        torch.testing.assert_close(
            got, ref, atol=2e-3, rtol=0, msg=lambda m, name=case.name: f"{name}: {m}"
        )
