"""Linear layers packed once for oneDNN: in bf16 the same numbers as ``nn.functional.linear``,
in fp32 (non-Intel AVX-512 CPUs) the same up to fp32 summation order; every linear of the model
replaced, the engine's tokens unchanged, and the plain path kept wherever packing does not
apply."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine.model import ckernel, packed_linear
from engine.model.packed_linear import PackedLinear, pack_linears, why_not

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    why_not(torch.bfloat16, CPU) is not None, reason=str(why_not(torch.bfloat16, CPU))
)
needs_fp32 = pytest.mark.skipif(
    why_not(torch.float32, CPU) is not None, reason=str(why_not(torch.float32, CPU))
)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Within ``rel`` of the largest value (fp32 summation order: another kernel than MKL's)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.abs().max().clamp_min(1e-6)
    err = ((got - want).abs().max() / scale).item()
    assert err <= rel, f"max error {err:.2e} of the largest value"


@needs_onednn
@pytest.mark.parametrize("rows", [1, 6, 37, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain_bit_for_bit(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    plain = nn.Linear(256, 768, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(plain)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    with torch.inference_mode():
        want = nn.functional.linear(x, plain.weight, plain.bias)
        got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 768)
    assert torch.equal(got, want)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128, bias=False)
        self.inner = nn.ModuleList([nn.Linear(128, 128, bias=True) for _ in range(2)])
        self.norm = nn.LayerNorm(128)
        self.down = nn.Linear(128, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for lin in self.inner:
            h = torch.relu(lin(h))
        return self.down(self.norm(h))


@needs_onednn
def test_every_linear_of_a_model_is_replaced_and_its_output_unchanged() -> None:
    torch.manual_seed(0)
    model = _Toy().to(torch.bfloat16).eval()
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
    assert pack_linears(model, torch.bfloat16, CPU) == 4
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.inner[1], PackedLinear)
    with torch.inference_mode():
        assert torch.equal(model(x), want)


def test_nothing_is_packed_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    model64 = _Toy().to(torch.float64).eval()
    assert pack_linears(model64, torch.float64, CPU) == 0
    assert "only bf16 or fp32 on CPU" in str(why_not(torch.float64, CPU))
    assert why_not(torch.float16, CPU) is not None
    assert why_not(torch.bfloat16, torch.device("cuda")) is not None
    assert why_not(torch.float32, torch.device("cuda")) is not None
    monkeypatch.setenv("CHUNKSCOPE_PACKED_LINEAR", "0")
    model16 = _Toy().to(torch.bfloat16).eval()
    assert why_not(torch.bfloat16, CPU) == "CHUNKSCOPE_PACKED_LINEAR=0"
    assert pack_linears(model16, torch.bfloat16, CPU) == 0
    assert all(type(m) is nn.Linear for m in (model16.up, model16.down))


def test_a_cpu_onednn_cannot_pack_for_packs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2-only CPU oneDNN refuses to pack bf16 weights: said once, every layer plain."""

    def refuse(*args: object) -> None:
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(packed_linear, "_refusal", {})
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    reason = why_not(torch.bfloat16, CPU)
    assert reason is not None and "does not pack bf16 weights on this CPU" in reason
    model = _Toy().to(torch.bfloat16).eval()
    assert pack_linears(model, torch.bfloat16, CPU) == 0
    assert all(type(m) is nn.Linear for m in (model.up, model.inner[0], model.down))


@needs_onednn
def test_a_packed_layer_that_disagrees_keeps_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_forward = PackedLinear.forward

    def off_by_a_lot(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return real_forward(self, x) * 1.5

    monkeypatch.setattr(PackedLinear, "forward", off_by_a_lot)
    model = _Toy().to(torch.bfloat16).eval()
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        assert pack_linears(model, torch.bfloat16, CPU) == 0
    assert "differs from the plain one" in caplog.text
    assert type(model.up) is nn.Linear


@needs_onednn
def test_a_onednn_refusal_keeps_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise RuntimeError("no AMX today")

    monkeypatch.setattr(packed_linear, "PackedLinear", refuse)
    model = _Toy().to(torch.bfloat16).eval()
    assert pack_linears(model, torch.bfloat16, CPU) == 0
    assert type(model.up) is nn.Linear


@needs_onednn
def test_engine_tokens_are_the_same_with_and_without_packing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    def tokens(packed: bool) -> list[list[int]]:
        monkeypatch.setenv("CHUNKSCOPE_PACKED_LINEAR", "1" if packed else "0")
        engine = LLMEngine(
            EngineConfig(
                model="tiny",
                device="cpu",
                dtype="bfloat16",
                token_budget=64,
                max_model_len=512,
                cpu_threads=1,
            )  # fmt: skip
        )
        kinds = {type(m).__name__ for m in engine.runner.model.modules()}
        assert ("PackedLinear" in kinds) is packed and ("Linear" in kinds) is not packed
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [list(range(3, 3 + n)) for n in (5, 90, 200)]
        ids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for o in engine.step().outputs:
                out[o.request_id].extend(o.new_token_ids)
        return [out[i] for i in ids]

    with_packing = tokens(True)
    assert all(len(t) == 12 for t in with_packing)
    assert with_packing == tokens(False)


# fp32: oneDNN's kernels over packed weights on non-Intel x86-64 CPUs with AVX-512


@needs_fp32
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 15, 16, 17, 37, 64, 65, 506, 512])
@pytest.mark.parametrize(("n", "k", "bias"), [(1024, 256, True), (256, 512, False), (40, 37, True)])
def test_fp32_packed_equals_linear(rows: int, n: int, k: int, bias: bool) -> None:
    torch.manual_seed(rows * n + k)
    plain = nn.Linear(k, n, bias=bias)
    packed = PackedLinear(plain)
    x = torch.randn(rows, k) * 4
    with torch.inference_mode():
        want = nn.functional.linear(x, plain.weight, plain.bias)
        got = packed(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    _close(got, want)


@needs_fp32
def test_fp32_leading_dims_strided_rows_and_no_rows() -> None:
    torch.manual_seed(0)
    plain = nn.Linear(64, 48)
    packed = PackedLinear(plain)
    x3 = torch.randn(2, 3, 64)
    wide = torch.randn(9, 100)[:, 10:74]  # rows 100 apart
    with torch.inference_mode():
        got3 = packed(x3)
        assert got3.shape == (2, 3, 48)
        _close(got3, plain(x3))
        _close(packed(wide), plain(wide))
        _close(packed(wide.t().contiguous().t()), plain(wide))
        assert packed(torch.empty(0, 64)).shape == (0, 48)


@needs_fp32
@pytest.mark.parametrize(("n", "k"), [(1024, 256), (256, 512), (512, 1024)])
def test_fp32_a_row_does_not_depend_on_its_batch(n: int, k: int) -> None:
    """What the module's docstring says of oneDNN's fp32 kernels at k <= 1024 (every linear of
    the issue-20 and tiny models): a row gives the same bits alone or among 2..512 others."""
    torch.manual_seed(n + k)
    packed = PackedLinear(nn.Linear(k, n))
    x = torch.randn(512, k)
    with torch.inference_mode():
        together = packed(x)
        for m in (1, 2, 5, 6, 7, 64, 65, 506):
            assert torch.equal(packed(x[:m]), together[:m]), m
        for i in (0, 6, 300, 511):
            assert torch.equal(packed(x[i : i + 1]), together[i : i + 1]), i


@needs_fp32
def test_fp32_every_linear_of_a_model_is_replaced() -> None:
    torch.manual_seed(0)
    model = _Toy().eval()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = model(x)
    assert pack_linears(model, torch.float32, CPU) == 4
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.inner[1], PackedLinear) and model.inner[1].bias is not None
    with torch.inference_mode():
        _close(model(x), want)


@needs_fp32
def test_fp32_a_packed_layer_off_by_more_than_summation_order_keeps_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_forward = PackedLinear.forward

    def off(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return real_forward(self, x) * (1 + 1e-4)

    monkeypatch.setattr(PackedLinear, "forward", off)
    model = _Toy().eval()
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        assert pack_linears(model, torch.float32, CPU) == 0
    assert "differs from the plain one" in caplog.text
    assert type(model.up) is nn.Linear


def test_fp32_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 is packed only on x86-64 CPUs with AVX-512 that are not Intel's; the switch turns it
    off; the panel kernel steps aside where it is packed."""
    from engine.model import panel_linear

    assert ckernel.cpu_vendor("processor\t: 0\nvendor_id\t: GenuineIntel\n") == "GenuineIntel"
    assert ckernel.cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\n") == "AuthenticAMD"
    assert ckernel.cpu_vendor("processor\t: 0\nCPU part\t: 0xd0c\n") is None
    onednn = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )
    monkeypatch.setattr(ckernel, "x86_unavailable", lambda switch, features: None)
    monkeypatch.setattr(ckernel, "cpu_vendor", lambda: "GenuineIntel")
    if onednn:
        assert "an Intel CPU: MKL's fp32 GEMM kept" in str(why_not(torch.float32, CPU))
    assert "oneDNN" not in str(panel_linear.why_not(torch.float32, CPU))
    monkeypatch.setattr(ckernel, "cpu_vendor", lambda: None)
    if onednn:
        assert "unknown CPU vendor" in str(why_not(torch.float32, CPU))
    monkeypatch.setattr(ckernel, "cpu_vendor", lambda: "AuthenticAMD")
    if onednn:
        assert why_not(torch.float32, CPU) is None
        assert "oneDNN packs fp32" in str(panel_linear.why_not(torch.float32, CPU))
    monkeypatch.setenv("CHUNKSCOPE_PACKED_LINEAR", "0")
    assert why_not(torch.float32, CPU) == "CHUNKSCOPE_PACKED_LINEAR=0"
    assert pack_linears(_Toy().eval(), torch.float32, CPU) == 0
    assert "oneDNN" not in str(panel_linear.why_not(torch.float32, CPU))
    monkeypatch.delenv("CHUNKSCOPE_PACKED_LINEAR")
    monkeypatch.setattr(ckernel, "x86_unavailable", lambda s, f: "the CPU lacks avx512f")
    if onednn:
        assert why_not(torch.float32, CPU) == "the CPU lacks avx512f: MKL's fp32 GEMM kept"


@needs_fp32
def test_fp32_engine_tokens_are_the_same_with_and_without_packing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    def tokens(packed: bool) -> list[list[int]]:
        monkeypatch.setenv("CHUNKSCOPE_PACKED_LINEAR", "1" if packed else "0")
        engine = LLMEngine(
            EngineConfig(model="tiny", device="cpu", dtype="float32", token_budget=64,
                         max_model_len=512, cpu_threads=1)
        )  # fmt: skip
        kinds = {type(m).__name__ for m in engine.runner.model.modules()}
        assert ("PackedLinear" in kinds) is packed and ("Linear" in kinds) is not packed
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [list(range(3, 3 + n)) for n in (5, 90, 200)]
        ids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for o in engine.step().outputs:
                out[o.request_id].extend(o.new_token_ids)
        return [out[i] for i in ids]

    with_packing = tokens(True)
    assert all(len(t) == 12 for t in with_packing)
    assert with_packing == tokens(False)
