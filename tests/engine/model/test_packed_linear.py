"""bf16 linear layers packed once for oneDNN: the same numbers as ``nn.functional.linear``, every
linear of the model replaced, and the plain path kept wherever packing does not apply."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine.model import packed_linear
from engine.model.packed_linear import PackedLinear, pack_linears, why_not

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    why_not(torch.bfloat16, CPU) is not None, reason=str(why_not(torch.bfloat16, CPU))
)


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
    model = _Toy().eval()  # fp32
    assert pack_linears(model, torch.float32, CPU) == 0
    assert why_not(torch.float32, CPU) is not None
    assert why_not(torch.bfloat16, torch.device("cuda")) is not None
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
