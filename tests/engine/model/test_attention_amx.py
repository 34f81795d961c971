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
]


@pytest.mark.parametrize("case", BACKEND_CASES, ids=[c.name for c in BACKEND_CASES])
def test_split_with_kernel_within_bf16_noise(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = amx.attention_prefix

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(amx, "attention_prefix", spy)
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
    real = amx.attention_prefix
    monkeypatch.setattr(amx, "attention_prefix", lambda *a: calls.append(1) or real(*a))
    got = run()
    assert calls
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    n = len(calls)
    ref = run()
    assert len(calls) == n and got == ref and len(ref) > 1


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
