"""The AVX-512 chunk attention kernel (engine/model/attention/vec.py) computes what attention
computes.

Kernel level, fp32 against a float64 reference within 1e-5 on paged layouts (shuffled blocks,
block sizes 16, 7 and 48, tails of keys and of 16-row tiles, GQA 1, 2 and 4, several sequences
in one call, a chunk at position 0, a 512-token chunk over 6,000 keys, a max that rises in a
later 256-key chunk); bf16 within bf16's own noise (torch's bf16 flash kernel against the same
reference); causality key by key. Backend level: the split backend with the kernel equals it
without (fp32 1e-5) and does call it. Engine level: greedy tokens unchanged in both dtypes.
A failed build and the switch fall back to torch's kernel. Head dim 128 (GQA 1 to 8, both
dtypes) against the same references; at two threads the same bits as at one.

The tests run the build this CPU takes (``vec.isa()``): on CPUs with AVX2 but no AVX-512 (the
CI machine), the AVX2 build of the same source (its AVX-512 intrinsics as pairs of 8-lane
vectors, ``avx512_on_avx2.h``), asked for with ``CHUNKSCOPE_VEC_ATTENTION=avx2``; the AVX-512
instructions themselves are then not run here. They skip only where neither builds.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.model.attention.vec as vec
from engine.core.config import EngineConfig
from engine.model import ckernel
from engine.model.attention.split import SplitBackend
from tests.engine.model.test_attention_amx import BACKEND_CASES
from tests.engine.model.test_attention_flex import GREEDY, LLMEngine
from tests.engine.model.test_attention_split import Case, _forward, _setup


def _build() -> str | None:
    """The build the tests run: this CPU's, else the AVX2 one where the CPU has AVX2 + FMA."""
    if vec.isa() is not None:
        return vec.isa()
    why = ckernel.x86_unavailable("CHUNKSCOPE_VEC_ATTENTION_TEST", vec.ISA_FEATURES["avx2"])
    return "avx2" if why is None else None


BUILD = _build()
pytestmark = [
    pytest.mark.skipif(BUILD is None, reason="neither AVX-512 nor AVX2 + FMA on this CPU"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH"),
]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if BUILD == "avx2":  # the AVX2 build runs where asked
        monkeypatch.setenv(vec.ENV_SWITCH, "avx2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cache(blocks: int, block_size: int, kv_heads: int, g: torch.Generator, dim: int = 64):
    kc = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    vc = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    return kc, vc


def _layout(spec: list[tuple[int, int]], block_size: int, kv_heads: int = 2, groups: int = 2,
            seed: int = 0, rise: int = 0, dim: int = 64):  # fmt: skip
    """Sequences ``(q_len, ctx_len)`` over shuffled blocks of one fp32 cache; q rows stacked in
    order. ``rise``: keys from that position on score higher (a row's max rises late)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for _, ctx in spec]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=g)
    kc, vc = _cache(nb, block_size, kv_heads, g, dim)
    width = max(need)
    table = torch.zeros(len(spec), width, dtype=torch.long)
    seqs, at, start = [], 0, 0
    for i, ((q_len, ctx), n) in enumerate(zip(spec, need, strict=True)):
        table[i, :n] = perm[at : at + n]
        at += n
        seqs.append((start, q_len, ctx))
        start += q_len
    if rise:
        for i, (_, ctx) in enumerate(spec):
            flat = kc[table[i, : need[i]]].flatten(0, 1)
            flat[rise:ctx] *= 3
            kc[table[i, : need[i]]] = flat.view(need[i], block_size, kv_heads, dim)
    q = torch.randn(start, kv_heads * groups, dim, generator=g) * 0.6
    return q, kc, vc, torch.tensor(seqs, dtype=torch.int32).view(-1, 3), table


def _reference(q, kc, vc, seqs, table) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """float64 causal attention of each sequence's rows over its keys in position order."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    groups = q.shape[1] // kc.shape[2]
    for (q0, q_len, ctx), blocks in zip(seqs.tolist(), table, strict=True):
        keys = kc[blocks].flatten(0, 1)[:ctx].double()  # [ctx, Hkv, 64]
        vals = vc[blocks].flatten(0, 1)[:ctx].double()
        qs = q[q0 : q0 + q_len].double().transpose(0, 1)  # [Hq, L, 64]
        ks = keys.repeat_interleave(groups, dim=1).transpose(0, 1)
        vs = vals.repeat_interleave(groups, dim=1).transpose(0, 1)
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        mask = torch.arange(ctx)[None, :] <= pos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        out[q0 : q0 + q_len] = o.transpose(0, 1)
    return out


def _run(q, kc, vc, seqs, table) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = torch.zeros_like(q)
    vec.attention_paged(q, kc, vc, seqs, table, out)
    return out


LAYOUTS = [
    ("one chunk at 0", [(16, 16)], 16, 2, 2),
    ("tails", [(5, 17)], 16, 2, 2),
    ("rows off the tile grid", [(37, 45)], 16, 2, 2),
    ("several sequences, one call", [(20, 300), (3, 3), (64, 700), (9, 1000)], 16, 2, 2),
    ("block size 7", [(19, 200), (40, 40)], 7, 2, 2),
    ("block size 48, GQA 4", [(45, 1100)], 48, 2, 4),
    ("no GQA", [(50, 130)], 16, 2, 1),
    ("one K/V head, GQA 4", [(33, 513)], 16, 1, 4),
    ("512 over 6,000", [(512, 6000)], 16, 2, 2),
    ("decodes beside a chunk", [(1, 200), (64, 700), (1, 1), (1, 17), (1, 1000)], 16, 2, 2),
    ("decodes, GQA 8", [(1, 300), (1, 33)], 16, 1, 8),
    ("decodes, block size 7, GQA 4", [(1, 90), (1, 7)], 7, 2, 4),
    ("decodes, GQA 16", [(1, 50)], 16, 1, 16),
]


@pytest.mark.parametrize(
    ("spec", "block_size", "kv_heads", "groups"),
    [lay[1:] for lay in LAYOUTS],
    ids=[lay[0] for lay in LAYOUTS],
)
def test_fp32_equals_reference(spec, block_size: int, kv_heads: int, groups: int) -> None:  # type: ignore[no-untyped-def]
    case = _layout(spec, block_size, kv_heads, groups)
    got = _run(*case)
    torch.testing.assert_close(got.double(), _reference(*case), atol=1e-5, rtol=1e-5)


HEAD_128 = [
    ("chunk and decodes, no GQA", [(37, 300), (1, 45), (1, 1)], 16, 2, 1),
    ("several chunks, GQA 2", [(64, 700), (9, 1000), (20, 20)], 16, 2, 2),
    ("block size 7, GQA 4", [(19, 200), (1, 90)], 7, 2, 4),
    ("one K/V head, GQA 8", [(33, 513), (1, 300), (1, 7)], 16, 1, 8),
]


@pytest.mark.parametrize(
    ("spec", "block_size", "kv_heads", "groups"),
    [lay[1:] for lay in HEAD_128],
    ids=[lay[0] for lay in HEAD_128],
)
def test_head_dim_128_fp32_equals_reference(  # type: ignore[no-untyped-def]
    spec, block_size: int, kv_heads: int, groups: int
) -> None:
    case = _layout(spec, block_size, kv_heads, groups, dim=128)
    got = _run(*case)
    torch.testing.assert_close(got.double(), _reference(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("spec", "block_size", "kv_heads", "groups"),
    [lay[1:] for lay in HEAD_128],
    ids=[lay[0] for lay in HEAD_128],
)
def test_head_dim_128_bf16_within_bf16_noise(  # type: ignore[no-untyped-def]
    spec, block_size: int, kv_heads: int, groups: int
) -> None:
    q, kc, vc, seqs, table = _layout(spec, block_size, kv_heads, groups, dim=128)
    q16, k16, v16 = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    ref = _reference(q16.float(), k16.float(), v16.float(), seqs, table)
    got = _run(q16, k16, v16, seqs, table).double()
    noise = (_reference(q16, k16, v16, seqs, table).bfloat16().double() - ref).abs()
    err = (got - ref).abs()  # the kernel rounds once (its fp32 result to bf16), as this does
    assert float(err.max()) <= 2 * float(noise.max()) + 1e-6
    assert float(err.mean()) <= 1.25 * float(noise.mean()) + 1e-6


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_threads_give_one_threads_bits(dim: int, dtype: torch.dtype) -> None:
    """The jobs (a sequence's K/V head, a chunk's range of query tiles) are computed alike
    whichever thread takes them and however the tiles are cut."""
    if not vec.threaded(dim):
        pytest.skip("the kernel was built without OpenMP here")
    spec = [(200, 900), (1, 300), (64, 64), (1, 17), (5, 400)]
    q, kc, vc, seqs, table = _layout(spec, 16, 2, 4, dim=dim)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    outs = []
    for threads in (1, 2, 3):
        out = torch.zeros_like(q)
        vec.attention_paged(q, kc, vc, seqs, table, out, threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0].double(), _reference(q, kc, vc, seqs, table),
                               atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)  # fmt: skip


def test_fp32_max_rising_in_a_later_chunk() -> None:
    case = _layout([(40, 1500)], 16, rise=600)
    torch.testing.assert_close(_run(*case).double(), _reference(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "spec", [[(37, 45)], [(64, 700), (9, 1000)], [(512, 2100)], [(1, 300), (1, 45), (40, 500)]]
)
def test_bf16_within_bf16_noise(spec) -> None:  # type: ignore[no-untyped-def]
    q, kc, vc, seqs, table = _layout(spec, 16)
    q16, k16, v16 = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    ref = _reference(q16.float(), k16.float(), v16.float(), seqs, table)
    got = _run(q16, k16, v16, seqs, table).double()
    noise = []  # torch's bf16 flash kernel on the same inputs, sequence by sequence
    for (q0, q_len, ctx), blocks in zip(seqs.tolist(), table, strict=True):
        ks = k16[blocks].flatten(0, 1)[:ctx].repeat_interleave(2, dim=1).transpose(0, 1)
        vs = v16[blocks].flatten(0, 1)[:ctx].repeat_interleave(2, dim=1).transpose(0, 1)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
        o = F.scaled_dot_product_attention(q16[q0 : q0 + q_len].transpose(0, 1), ks, vs,
                                           attn_mask=mask)  # fmt: skip
        noise.append((o.transpose(0, 1).double() - ref[q0 : q0 + q_len]).abs())
    bf16_noise = torch.cat([n.flatten() for n in noise])
    err = (got - ref).abs()
    assert float(err.max()) <= 2 * float(bf16_noise.max())
    assert float(err.mean()) <= 1.25 * float(bf16_noise.mean())


def test_future_key_is_unseen_and_each_past_key_counts() -> None:
    """A key made to dominate one row's scores: at the row's position or any earlier one (block
    edges, the first key) the row's output is that key's value; one position later it must not
    move the row at all (causal)."""
    q, kc, vc, seqs, table = _layout([(40, 90)], 16)
    start = 50
    flat_k = kc[table[0, :6]].flatten(0, 1)
    flat_v = vc[table[0, :6]].flatten(0, 1)
    for i, j in [(0, 50), (0, 0), (5, 31), (5, 32), (20, 47), (39, 89), (13, 63)]:
        k2 = kc.clone()
        f2 = flat_k.clone()
        f2[j] = torch.stack([q[i, 0] * 40, q[i, 2] * 40])
        k2[table[0, :6]] = f2.view(6, 16, 2, 64)
        out = _run(q, k2, vc, seqs, table)
        assert float((out[i, [0, 2]] - flat_v[j]).abs().max()) < 1e-4, (i, j)
        if j == start + i and i + 1 < 40:
            k3 = kc.clone()
            f3 = flat_k.clone()
            f3[j + 1] = f2[j]
            k3[table[0, :6]] = f3.view(6, 16, 2, 64)
            assert torch.equal(
                _run(q, k3, vc, seqs, table)[: i + 1], _run(*_layout([(40, 90)], 16))[: i + 1]
            )


def test_usable_only_where_the_kernel_serves() -> None:
    q, kc, _, _, _ = _layout([(4, 20)], 16)
    assert vec.usable(q, kc) and vec.usable(q.bfloat16(), kc.bfloat16())
    assert not vec.usable(q, kc.bfloat16())  # mixed dtypes
    assert not vec.usable(q.half(), kc.half())
    assert not vec.usable(q[..., :32], kc[..., :32])  # head dim 32
    q2, kc2, _, _, _ = _layout([(4, 20)], 16, dim=128)
    assert vec.usable(q2, kc2) and vec.usable(q2.bfloat16(), kc2.bfloat16())
    torch.set_num_threads(2)
    assert vec.usable(q, kc) == vec.threaded(64)  # more threads: with OpenMP only
    wide = torch.zeros(4, 17, 64)  # 17 query heads on one K/V head
    assert not vec.usable(wide, kc[:, :, :1])


def test_refuses_bad_input() -> None:
    q, kc, vc, seqs, table = _layout([(40, 90)], 16)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="out of range"):
        vec.attention_paged(q, kc, vc, seqs, table + 100, out)
    with pytest.raises(ValueError, match="out of range"):
        vec.attention_paged(q[:10], kc, vc, seqs, table, out[:10])
    with pytest.raises(ValueError, match="int32"):
        vec.attention_paged(q, kc, vc, seqs.long(), table, out)
    with pytest.raises(ValueError, match="bad shapes"):
        vec.attention_paged(q, kc, vc, seqs, table, out.bfloat16())
    with pytest.raises(ValueError, match="bad shapes"):
        vec.attention_paged(q[..., :32], kc[..., :32], vc[..., :32], seqs, table, out[..., :32])
    with pytest.raises(RuntimeError, match="failed"):  # ctx_len past the table's blocks
        vec.attention_paged(q, kc, vc, torch.tensor([[0, 40, 900]], dtype=torch.int32), table, out)
    assert not out.any()  # nothing written


# --- in the split backend -------------------------------------------------------------------------
@pytest.mark.parametrize("case", BACKEND_CASES, ids=[c.name for c in BACKEND_CASES])
def test_split_with_kernel_equals_torch_path(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")  # the path this kernel serves
    calls = []
    real = vec.attention_paged
    monkeypatch.setattr(vec, "attention_paged", lambda *a, **k: calls.append(1) or real(*a, **k))
    seqs, cache, qkv = _setup(case)
    got = _forward(SplitBackend(), case, seqs, cache, qkv)
    assert calls  # the kernel ran
    monkeypatch.setenv(vec.ENV_SWITCH, "0")
    n = len(calls)
    ref = _forward(SplitBackend(), case, seqs, cache, qkv)
    assert len(calls) == n
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    model = build_llama_folder(tmp_path / "llama", hidden_size=128, num_layers=2)
    prompt = [(i * 37) % 200 + 3 for i in range(300)]

    def run() -> list[int]:
        engine = LLMEngine(
            EngineConfig(
                model=str(model), device="cpu", dtype=dtype, token_budget=64,
                max_token_budget=64, num_kv_blocks=64, cpu_threads=1, seed=0,
            )
        )  # fmt: skip
        rid = engine.add_request(prompt, GREEDY)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                if out.request_id == rid:
                    tokens.extend(out.new_token_ids)
        return tokens

    calls = []
    real = vec.attention_paged
    monkeypatch.setattr(vec, "attention_paged", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run()
    assert calls
    monkeypatch.setenv(vec.ENV_SWITCH, "0")
    n = len(calls)
    ref = run()
    assert len(calls) == n and got == ref and len(ref) > 1


# --- availability ---------------------------------------------------------------------------------
def test_failed_build_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    vec.reset()
    try:
        with caplog.at_level(logging.INFO, logger=vec.__name__):
            assert vec.kernel() is None
            assert vec.kernel() is None  # logged once
        (rec,) = [r for r in caplog.records if "not used" in r.getMessage()]
        assert "no-such-compiler" in rec.getMessage()
        case = BACKEND_CASES[0]
        seqs, cache, qkv = _setup(case)
        got = _forward(SplitBackend(), case, seqs, cache, qkv)  # torch's kernel
        monkeypatch.setenv(vec.ENV_SWITCH, "0")
        torch.testing.assert_close(got, _forward(SplitBackend(), case, seqs, cache, qkv))
    finally:
        vec.reset()


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vec.ENV_SWITCH, "0")
    assert not vec.enabled()
    assert not SplitBackend()._vec
