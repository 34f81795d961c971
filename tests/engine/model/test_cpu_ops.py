"""The element-wise C kernels (``cpu_ops``) against the torch expressions they replace: bf16 equal
to the bit but for rare one-ulp differences, fp32 within 1e-6; strided views as the model hands
them; the model's forward unchanged; torch's ops wherever the kernels cannot run."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from engine.model import cpu_ops
from engine.model.arch import PRESETS
from engine.model.llama import MLP, LlamaModel, RMSNorm
from engine.model.rope import RotaryEmbedding, apply_rotary

needs_kernel = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ops(dtype: torch.dtype) -> cpu_ops.CpuOps:
    ops = cpu_ops.step_ops(torch.empty(1, 1, dtype=dtype))
    assert ops is not None
    return ops


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within 1e-6 of the value's scale. bf16: at most one ulp anywhere, and on at most
    1% of the values (a different summation order or exp can round the other way)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-6)
        return
    g, w = got.float(), want.float()
    ulp = w.abs().clamp_min(1e-30) * 2.0**-7  # a bf16 ulp is at most 2^-7 of the value
    diff = (g - w).abs()
    assert bool((diff <= ulp * 1.001).all()), float((diff / ulp).max())
    assert float((diff > 0).float().mean()) <= 0.01


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6, 506])
def test_add_rms_norm_equals_add_then_rmsnorm(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(256, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256, generator=g))
    norm = norm.to(dtype)
    h = (3 * torch.randn(rows, 256, generator=g)).to(dtype)
    delta = torch.randn(rows, 256, generator=g).to(dtype)
    want_h = h + delta
    with torch.inference_mode():
        want_x = norm.forward(want_h)
        ops = _ops(dtype)
        mine = h.clone()
        x = ops.add_rms_norm(mine, delta, norm.weight, norm.eps)
        assert torch.equal(mine, want_h)  # the residual add: one rounding, as torch's
        _close(x, want_x)
        alone = ops.add_rms_norm(want_h.clone(), None, norm.weight, norm.eps)
        _close(alone, norm.forward(want_h))


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_mul_equals_the_mlp_activation(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    gu = (4 * torch.randn(rows, 2 * 96, generator=g)).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
    gate, up = gu.split(96, dim=-1)
    want = nn.functional.silu(gate) * up
    with torch.inference_mode():
        _close(_ops(dtype).silu_mul(gu), want)


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_rope_in_place_on_the_qkv_views(dtype: torch.dtype, scaling: dict | None) -> None:
    """q and k as the attention layer has them: views of one qkv output (row stride of the
    whole row), rotated in place; v untouched."""
    heads, kv_heads, dim, rows = 4, 2, 64, 37
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(rows, heads, dim), k.view(rows, kv_heads, dim), v.view(rows, kv_heads, dim)
    rope = RotaryEmbedding(dim, 4096, 10000.0, scaling)
    cos, sin = rope.tables(torch.randint(0, 4096, (rows,), generator=g), dtype)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    v_before = v.clone()
    ops = _ops(dtype)
    with torch.inference_mode():
        got_q, got_k = ops.rope_(q, cos, sin), ops.rope_(k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()
    if dtype == torch.float32:  # the same three ops, no FMA: bit-equal
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:
        _close(got_q, want_q)
        _close(got_k, want_k)
    assert torch.equal(v, v_before)


@needs_kernel
@pytest.mark.usefixtures("one_thread")
def test_bad_tensors_are_refused_and_nothing_is_written() -> None:
    ops = _ops(torch.float32)
    h = torch.randn(4, 32)
    before = h.clone()
    with pytest.raises(ValueError, match="add_rms_norm"):
        ops.add_rms_norm(h, torch.randn(4, 16), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="add_rms_norm"):
        ops.add_rms_norm(h, None, torch.ones(32, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(h, before)
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="rope_"):
        ops.rope_(torch.randn(3, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8))


def _model(dtype: torch.dtype) -> LlamaModel:
    model = LlamaModel(PRESETS["tiny"], max_positions=512)
    model.init_synthetic(seed=5)
    return model.to(dtype).eval()


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", DTYPES)
def test_mlp_and_model_forward_unchanged(dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The layer loop with the kernels against the torch loop, on the same inputs: the model's
    hidden states within bf16's noise (fp32: 1e-5)."""
    from engine.model.attention.sdpa import SdpaBackend
    from tests.engine.model.test_attention_split import Case, _layout

    model = _model(dtype)
    arch = model.arch
    case = Case("x", [(40, 40, "a"), (1, 70, "b"), (1, 9, "c")], head_dim=arch.head_dim)
    seqs = _layout(case, 20)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, arch.vocab_size, (42,), generator=g)
    positions = torch.tensor(list(range(40)) + [69, 8])
    backend = SdpaBackend()
    meta = backend.prepare_metadata(seqs, 16, torch.device("cpu"))
    cache = [
        tuple(
            torch.randn(20, 16, arch.num_key_value_heads, arch.head_dim, generator=g).to(dtype)
            for _ in range(2)
        )
        for _ in range(arch.num_hidden_layers)
    ]
    used: list[bool] = []
    real = cpu_ops.step_ops

    def spy(h: torch.Tensor):  # type: ignore[no-untyped-def]
        ops = real(h)
        used.append(ops is not None)
        return ops

    monkeypatch.setattr("engine.model.llama.step_ops", spy)
    got = model(ids, positions, [tuple(c.clone() for c in kv) for kv in cache], meta, backend)
    monkeypatch.setattr("engine.model.llama.step_ops", lambda h: None)
    want = model(ids, positions, [tuple(c.clone() for c in kv) for kv in cache], meta, backend)
    assert used == [True]
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # a one-ulp difference early can grow through four layers; stays at bf16's scale
        assert float((got.float() - want.float()).abs().max()) < 0.05 * float(want.abs().max())
        assert float((got.float() - want.float()).abs().mean()) < 0.005
    x = torch.randn(5, arch.hidden_size, generator=g).to(dtype)
    mlp: MLP = model.layers[0].mlp
    with torch.inference_mode():
        _close(mlp.down_proj(_ops(dtype).silu_mul(mlp.gate_up_proj(x))), mlp.forward(x))


@pytest.mark.parametrize("why", ["switched off", "no compiler", "two threads", "float16"])
def test_torch_runs_where_the_kernels_cannot(
    why: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    before = torch.get_num_threads()
    cpu_ops.reset()
    try:
        if why == "switched off":
            monkeypatch.setenv("CHUNKSCOPE_CPU_OPS", "0")
        elif why == "no compiler":
            monkeypatch.setenv("CC", "/nonexistent/cc")
            monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", "/tmp/chunkscope-test-no-cc-cache")
        torch.set_num_threads(2 if why == "two threads" else 1)
        dtype = torch.float16 if why == "float16" else torch.float32
        with caplog.at_level(logging.INFO, logger=cpu_ops.__name__):
            assert cpu_ops.step_ops(torch.empty(2, 2, dtype=dtype)) is None
    finally:
        torch.set_num_threads(before)
        cpu_ops.reset()
    if why in ("switched off", "no compiler"):
        assert "CPU element-wise kernels not used" in caplog.text
