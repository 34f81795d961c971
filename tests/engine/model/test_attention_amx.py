"""The AMX bf16 prefix kernel (engine/model/attention/amx.py) computes what attention computes.

Kernel level against an fp32 reference of the same bf16 inputs, within bf16's own noise (the
yardstick of test_attention_split.py: torch's bf16 flash kernel against the same reference):
tails (keys not a multiple of 32 or 16, rows not a multiple of 16), GQA-stacked rows, K/V read
with a cache's row stride, prefixes of 1 .. 6,000 keys, a max that rises in a later 512-key
chunk (the rescale between chunks); the log-sum-exp against the reference. Backend level: the
split backend with the kernel on equals it off within that noise and does call the kernel.
Engine level: greedy tokens unchanged. A failed build falls back to torch's kernel.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine.model.attention.amx as amx
from engine.core.config import EngineConfig
from engine.model.attention.split import SplitBackend
from tests.engine.model.test_attention_flex import GREEDY, LLMEngine
from tests.engine.model.test_attention_split import Case, _forward, _setup

WHY_NOT = amx._why_not()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"AMX kernel unusable here: {WHY_NOT}"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH"),
]

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@pytest.fixture(autouse=True)
def no_vec(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the AMX kernel off, a bf16 step here is to go to torch's flash kernel (the
    references below), not to the AVX-512 kernel (attention/vec.py) these CPUs can also run."""
    monkeypatch.setenv("CHUNKSCOPE_VEC_ATTENTION", "0")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(rows: int, keys: int, heads: int = 2, seed: int = 0, rise: bool = False):
    """bf16 q ``[H, R, 64]`` and k, v ``[keys, H, 64]`` as a slice of a bigger flat cache (row
    stride H*64, not starting at 0). ``rise``: keys past 600 score higher (the max of a row
    rises in the second 512-key chunk)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(heads, rows, 64, generator=g) * 0.6).bfloat16()
    kc = torch.randn(keys + 9, heads, 64, generator=g)
    if rise:
        kc[600:] *= 3
    vc = torch.randn(keys + 9, heads, 64, generator=g)
    return q, kc.bfloat16()[5 : 5 + keys], vc.bfloat16()[5 : 5 + keys]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    out, lse = amx.attention_prefix(q, k, v)
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    ref, ref_lse = FLASH(q.float()[None], kt.float(), vt.float())
    b16, _ = FLASH(q[None], kt, vt)
    noise = (b16[0].float() - ref[0]).abs()
    err = (out - ref[0]).abs()
    tiny = 1e-6  # one key: both outputs are v exactly
    assert float(err.max()) <= 2 * float(noise.max()) + tiny
    assert float(err.mean()) <= 1.25 * float(noise.mean()) + tiny
    torch.testing.assert_close(lse, ref_lse[0], atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("rows", "keys"),
    [(16, 32), (1, 1), (5, 17), (37, 45), (16, 31), (33, 512), (20, 513), (48, 1055), (70, 6000)],
)
def test_kernel_within_bf16_noise(rows: int, keys: int) -> None:
    _check(*_inputs(rows, keys))


def test_kernel_max_rising_in_a_later_chunk() -> None:
    _check(*_inputs(40, 1500, rise=True))


def test_kernel_one_head_and_four_heads() -> None:
    _check(*_inputs(24, 300, heads=1))
    _check(*_inputs(24, 300, heads=4))


def test_kernel_each_key_counts() -> None:
    """One key far above the rest (each position in turn, tails included) takes almost all the
    weight: a key skipped anywhere moves the output from its value."""
    q, k, v = _inputs(16, 77)
    for j in (0, 31, 32, 63, 64, 76):
        k2 = k.clone()
        k2[j] = (q[:, 0] * 8).to(torch.bfloat16)  # row 0 of each head scores it highest
        out, _ = amx.attention_prefix(q, k2, v)
        assert float((out[:, 0] - v[j].float()).abs().max()) < 0.05, j


def test_kernel_refuses_bad_shapes() -> None:
    q, k, v = _inputs(4, 10)
    with pytest.raises(ValueError, match="bad shapes"):
        amx.attention_prefix(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="bad shapes"):
        amx.attention_prefix(q[..., :32], k[..., :32], v[..., :32])


# --- in the split backend -------------------------------------------------------------------------
BACKEND_CASES = [
    Case("scattered blocks, GQA", [(64, 700, "a"), (1, 90, "b"), (20, 60, "c")], head_dim=64),
    Case("consecutive, GQA 4", [(37, 1003, "a"), (3, 29, "b")], heads=(8, 2), head_dim=64),
    Case("consecutive, block size 7", [(19, 200, "a")], 7, head_dim=64, consecutive=True),
    # a 512-token chunk whose own keys span two 512-key kernel chunks, beside six decodes
    Case(
        "chunk of 512 over 1,600, decodes",
        [(512, 1600, "a")] + [(1, 200 + 13 * i, f"d{i}") for i in range(6)],
        head_dim=64,
    ),
    Case("scattered, block size 7, GQA 4", [(45, 300, "a"), (1, 7, "b")], 7, 64, (8, 2)),
    Case("scattered, block size 48", [(100, 1100, "a"), (1, 49, "b")], 48, head_dim=64),
    Case("whole prompt in one chunk, no GQA", [(70, 70, "a")], heads=(2, 2), head_dim=64),
]


@pytest.mark.parametrize("case", BACKEND_CASES, ids=[c.name for c in BACKEND_CASES])
def test_split_with_kernel_within_bf16_noise(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = amx.attention_paged

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(amx, "attention_paged", spy)
    seqs, cache, qkv = _setup(case)
    ref32 = _forward(SplitBackend(), case, seqs, cache, qkv)
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    ref16 = _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)
    assert not calls
    monkeypatch.delenv("CHUNKSCOPE_AMX_ATTENTION")
    got = _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)
    assert calls  # the kernel ran
    noise = (ref16 - ref32).abs()
    err = (got - ref32).abs()
    assert float(err.max()) <= 2 * float(noise.max())
    assert float(err.mean()) <= 1.25 * float(noise.mean())


def test_engine_tokens_unchanged_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    model = build_llama_folder(tmp_path / "llama", hidden_size=128, num_layers=2)
    prompt = [(i * 37) % 200 + 3 for i in range(300)]

    def run() -> list[int]:
        engine = LLMEngine(
            EngineConfig(
                model=str(model), device="cpu", dtype="bfloat16", token_budget=64,
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
    real = amx.attention_paged
    monkeypatch.setattr(amx, "attention_paged", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run()
    assert calls
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    n = len(calls)
    ref = run()
    assert len(calls) == n and got == ref and len(ref) > 1


# --- the paged kernel called directly -------------------------------------------------------------
def _paged_setup(block_size: int, ctx: int, q_len: int, seed: int = 0):
    """One sequence over shuffled blocks of a bf16 cache ``[nb, bs, 2, 64]``; q ``[q_len, 4, 64]``
    (GQA 2) at positions ``[ctx - q_len, ctx)``."""
    g = torch.Generator().manual_seed(seed)
    need = -(-ctx // block_size)
    nb = need + 5
    blocks = torch.randperm(nb, generator=g)[:need]
    kc = torch.randn(nb, block_size, 2, 64, generator=g).bfloat16()
    vc = torch.randn(nb, block_size, 2, 64, generator=g).bfloat16()
    q = (torch.randn(q_len, 4, 64, generator=g) * 0.6).bfloat16()
    seqs = torch.tensor([[0, q_len, ctx]], dtype=torch.int32)
    return q, kc, vc, seqs, blocks[None].long()


def _keys(cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> torch.Tensor:
    return cache[blocks[0]].flatten(0, 1)[:ctx]  # [ctx, 2, 64] in position order


def test_paged_future_key_is_unseen_and_each_past_key_counts() -> None:
    """A key made to dominate row i's scores (the row at position p = start + i): at p itself or
    any earlier position (block edges, the first and the last key) the row's output is that
    key's value; one position later it must not move the row at all (causal)."""
    q, kc, vc, seqs, table = _paged_setup(16, 90, 40)
    start, heads = 50, (0, 2)  # query heads 0 and 2: one of each K/V head
    for i, j in [(0, 50), (0, 0), (5, 31), (5, 32), (20, 47), (39, 89), (13, 63)]:
        k2 = kc.clone()
        flat = k2[table[0]].flatten(0, 1)
        flat[j] = torch.stack([q[i, 0] * 8, q[i, 2] * 8]).bfloat16()
        k2[table[0]] = flat.view(-1, 16, 2, 64)
        out = torch.zeros_like(q)
        amx.attention_paged(q, k2, vc, seqs, table, out)
        want = _keys(vc, table, 90)[j].float()
        assert float((out[i, list(heads)].float() - want).abs().max()) < 0.05, (i, j)
        if j == start + i and i + 1 < 40:  # the next key, one past the row's position
            k3 = kc.clone()
            f3 = k3[table[0]].flatten(0, 1)
            f3[j + 1] = flat[j]
            k3[table[0]] = f3.view(-1, 16, 2, 64)
            base, moved = torch.zeros_like(q), torch.zeros_like(q)
            amx.attention_paged(q, kc, vc, seqs, table, base)
            amx.attention_paged(q, k3, vc, seqs, table, moved)
            assert torch.equal(moved[: i + 1], base[: i + 1])


def test_paged_refuses_bad_input() -> None:
    q, kc, vc, seqs, table = _paged_setup(16, 90, 40)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="out of range"):
        amx.attention_paged(q, kc, vc, seqs, table + 100, out)
    with pytest.raises(ValueError, match="out of range"):
        amx.attention_paged(q[:10], kc, vc, seqs, table, out[:10])
    with pytest.raises(ValueError, match="int32"):
        amx.attention_paged(q, kc, vc, seqs.long(), table, out)
    with pytest.raises(ValueError, match="bad shapes"):
        amx.attention_paged(q, kc, vc, seqs, table, out.float())
    with pytest.raises(RuntimeError, match="failed"):  # ctx_len past the table's blocks
        amx.attention_paged(q, kc, vc, torch.tensor([[0, 40, 900]], dtype=torch.int32), table, out)
    assert not out.any()  # nothing written


# --- availability ---------------------------------------------------------------------------------
def test_failed_build_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    amx.reset()
    try:
        with caplog.at_level(logging.INFO, logger=amx.__name__):
            assert amx.prefix_kernel() is None
            assert amx.prefix_kernel() is None  # logged once
        (rec,) = [r for r in caplog.records if "not used" in r.getMessage()]
        assert "no-such-compiler" in rec.getMessage()
        case = BACKEND_CASES[0]
        seqs, cache, qkv = _setup(case)
        got = _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)  # torch's kernel
        monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
        torch.testing.assert_close(
            got, _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)
        )
        assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left
    finally:
        amx.reset()


def test_build_is_cached_by_source_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", str(tmp_path))
    lib = amx.build()
    assert lib.parent == tmp_path and lib.exists()
    stamp = lib.stat().st_mtime_ns
    assert amx.build() == lib and lib.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]


def test_switched_off_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    assert amx._why_not() == "CHUNKSCOPE_AMX_ATTENTION=0"
    assert not SplitBackend()._amx
