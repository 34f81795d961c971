"""The fused fp32 row operations (engine/model/fused.py, fused_ops_f32.c) compute what llama.py's
torch ops do: RMSNorm, silu * up and rotary embedding against torch on the same fp32 inputs
(fp32 summation order and the exp inside silu apart), rows 1 .. 513, strided rows, large and
tiny values; the same bits at two threads as at one; greedy tokens with the fused ops on equal
those with them off; a failed build or the switch falls back to torch's ops."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.core.config import EngineConfig
from engine.model import fused
from engine.model.rope import RotaryEmbedding, apply_rotary
from tests.engine.model.test_attention_flex import GREEDY, LLMEngine

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _data(rows: int, cols: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * scale
    x[:, ::7] *= 1e-3  # tiny values beside large ones
    return x


def test_fp32_is_usable_here() -> None:
    assert fused.usable(torch.zeros(2, 16))
    assert not fused.usable(torch.zeros(2, 16, dtype=torch.float64))


def test_two_threads_give_one_threads_bits() -> None:
    """Rows are shared out to threads above 16,384 elements; each row is computed alike."""
    lib = fused.library_f32()
    assert lib is not None
    if not lib.f32_threaded():
        pytest.skip("the fused ops were built without OpenMP here")
    x, w = _data(300, 512, 1), _data(1, 512, 2)[0]
    gate_up = _data(300, 2 * 512, 3, scale=8.0)
    rope = RotaryEmbedding(64, 2048, 10000.0, None)
    cos, sin = rope.tables(torch.arange(300) * 5, torch.float32)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert fused.usable(x)
        q = _data(300, 8 * 64, 4).view(300, 8, 64)
        outs.append((fused.rms_norm(x, w, 1e-6), fused.silu_mul(gate_up, 512),
                     fused.rope_(q, cos, sin)))  # fmt: skip
    for one, two in zip(*outs, strict=True):
        assert torch.equal(one, two)


@pytest.mark.parametrize("rows", [1, 7, 513])
def test_rms_norm_equals_torch(rows: int) -> None:
    x, w = _data(rows, 256, rows), _data(1, 256, 99)[0]
    wide = torch.cat([x, _data(rows, 64, 5)], dim=1)[:, :256]  # rows 320 apart
    want = F.rms_norm(x, (256,), w, 1e-6)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), want, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(fused.rms_norm(wide, w, 1e-6), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 513])
def test_silu_mul_equals_torch(rows: int) -> None:
    gate_up = _data(rows, 2 * 512, rows + 1, scale=8.0)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails, zero
    gate, up = gate_up.split(512, dim=-1)
    got = fused.silu_mul(gate_up, 512)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("rows", "head_dim"), [(1, 64), (7, 128), (513, 32)])
def test_rope_in_place_equals_torch(rows: int, head_dim: int) -> None:
    rope = RotaryEmbedding(head_dim, 2048, 10000.0, None)
    positions = torch.randint(0, 2048, (rows,), generator=torch.Generator().manual_seed(rows))
    cos, sin = rope.tables(positions, torch.float32)
    qkv = _data(rows, 6 * head_dim, rows + 2)
    q = qkv[:, : 4 * head_dim].view(rows, 4, head_dim)  # views of a wider row, as in llama.py
    k = qkv[:, 4 * head_dim :].view(rows, 2, head_dim)
    want_q, want_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    fused.rope_(q, cos, sin)
    fused.rope_(k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=2e-6, atol=1e-6)


def test_engine_tokens_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    model = build_llama_folder(tmp_path / "llama", hidden_size=128, num_layers=2)
    prompts = [[(i * 37 + j) % 200 + 3 for i in range(n)] for j, n in enumerate((150, 9, 70))]

    def run() -> list[list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=str(model), device="cpu", dtype="float32", token_budget=64,
                max_token_budget=64, num_kv_blocks=64, cpu_threads=1, seed=0,
            )
        )  # fmt: skip
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids]

    calls: list[str] = []
    for name in ("rms_norm", "rope_", "silu_mul"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    got = run()
    assert set(calls) == {"rms_norm", "rope_", "silu_mul"}  # the fused path ran
    monkeypatch.setenv("CHUNKSCOPE_FUSED_OPS", "0")
    fused.reset()
    try:
        n = len(calls)
        ref = run()
    finally:
        fused.reset()
    assert len(calls) == n  # off: torch's ops ran
    assert got == ref and all(len(t) > 1 for t in ref)


def test_failed_build_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    fused.reset()
    try:
        with caplog.at_level(logging.INFO, logger=fused.__name__):
            assert not fused.usable(torch.zeros(2, 16))
            assert fused.library_f32() is None  # logged once
        (rec,) = [r for r in caplog.records if "fp32" in r.getMessage()]
        assert "no-such-compiler" in rec.getMessage()
    finally:
        fused.reset()
