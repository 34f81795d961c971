"""The fused bf16 row operations (engine/model/fused.py) compute what llama.py's torch ops do.

RMSNorm and silu * up against torch's op sequence on the same bf16 inputs: equal but for at
most one bf16 ulp on a handful of elements (fp32 summation order, the exp inside silu); rotary
embedding bit-equal. Rows 1 .. 513, strided rows (views of a wider tensor), large and tiny
values. Engine level: greedy tokens with the fused ops on equal those with them off. A failed
build or the switch falls back to torch's ops.
"""

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

WHY_NOT = fused._why_not()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"fused ops unusable here: {WHY_NOT}"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on PATH"),
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for one bf16 ulp on at most 0.1% of the elements."""
    assert got.dtype == ref.dtype == torch.bfloat16 and got.shape == ref.shape
    diff = got != ref
    ulp = ref.float().abs().clamp_min(1e-30) * 2**-7
    assert bool(((got.float() - ref.float()).abs() <= ulp).all())
    assert int(diff.sum()) <= max(2, ref.numel() // 1000)


def _data(rows: int, cols: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * scale
    x[:, ::7] *= 1e-3  # tiny values beside large ones
    return x.bfloat16()


@pytest.mark.parametrize("rows", [1, 7, 513])
def test_rms_norm_equals_torch(rows: int) -> None:
    wide = _data(rows, 288, rows)
    x = wide[:, 16:272]  # a strided view
    w = (1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(1))).bfloat16()
    ref = w * F.rms_norm(x.float(), (256,), None, 1e-5).to(torch.bfloat16)
    _close(fused.rms_norm(x, w, 1e-5), ref)


@pytest.mark.parametrize("rows", [1, 7, 513])
def test_silu_mul_equals_torch(rows: int) -> None:
    gu = _data(rows, 1024, rows)
    ref = F.silu(gu[:, :512]) * gu[:, 512:]
    _close(fused.silu_mul(gu, 512), ref)


@pytest.mark.parametrize(("rows", "head_dim"), [(1, 64), (9, 128), (513, 64)])
def test_rope_in_place_equals_torch(rows: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 7 * head_dim, generator=g).bfloat16()
    q = qkv[:, : 4 * head_dim].view(rows, 4, head_dim)
    k = qkv[:, 4 * head_dim : 6 * head_dim].view(rows, 2, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    cos, sin = rope.tables(torch.randint(0, 4096, (rows,), generator=g), torch.bfloat16)
    ref_q, ref_k = apply_rotary(q, k, cos, sin)
    v_before = qkv[:, 6 * head_dim :].clone()
    fused.rope_(q, cos, sin)
    fused.rope_(k, cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(qkv[:, 6 * head_dim :], v_before)  # the rest of the row untouched


def test_bad_layouts_are_refused() -> None:
    x = _data(4, 256, 0)
    with pytest.raises(ValueError, match="bad weight"):
        fused.rms_norm(x, torch.ones(128, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="bad layout"):
        fused.rms_norm(x[:, :250], torch.ones(250, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="bad shape"):
        fused.silu_mul(x, 100)
    q = torch.zeros(4, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bad layout"):
        fused.rope_(q, q[:, :1], q[:, :1])


def test_engine_tokens_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    model = build_llama_folder(tmp_path / "llama", hidden_size=128, num_layers=2)
    prompts = [[(i * 37 + j) % 200 + 3 for i in range(n)] for j, n in enumerate((150, 9, 70))]

    def run() -> list[list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=str(model), device="cpu", dtype="bfloat16", token_budget=64,
                max_token_budget=64, num_kv_blocks=64, cpu_threads=1, seed=0,
            )
        )  # fmt: skip
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
        return [tokens[i] for i in ids]

    calls = []
    real = fused.rms_norm
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1) or real(*a))
    got = run()
    assert calls  # the fused path ran
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
            assert not fused.usable(torch.zeros(2, 16, dtype=torch.bfloat16))
            assert fused.library() is None  # logged once
        (rec,) = [r for r in caplog.records if "not used" in r.getMessage()]
        assert "no-such-compiler" in rec.getMessage()
    finally:
        fused.reset()
    monkeypatch.setenv("CHUNKSCOPE_FUSED_OPS", "0")
    assert fused._why_not() == "CHUNKSCOPE_FUSED_OPS=0"
