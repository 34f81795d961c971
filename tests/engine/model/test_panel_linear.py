"""fp32 linear layers over panel-packed weights: equal to ``nn.functional.linear`` up to fp32
summation order at every row count, batch-invariant, the same bits at two and three threads as
at one, every linear of a model replaced, the engine's tokens unchanged, and torch's linear kept
wherever the kernel does not apply (a build without OpenMP at two threads among them)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from engine.model import panel_linear
from engine.model.panel_linear import PanelLinear, pack_panels, why_not

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread() -> None:  # type: ignore[misc]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _needs_kernel() -> None:
    torch.set_num_threads(1)
    reason = why_not(torch.float32, CPU)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64, 512])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 37, True), (512, 256, False), (96, 512, True)])
def test_panel_equals_linear(rows: int, n: int, k: int, bias: bool) -> None:
    _needs_kernel()
    torch.manual_seed(rows * n + k)
    plain = nn.Linear(k, n, bias=bias)
    panel = PanelLinear(plain)
    x = torch.randn(rows, k)
    with torch.inference_mode():
        want = nn.functional.linear(x, plain.weight, plain.bias)
        got = panel(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 7, 64, 300])
def test_threads_give_one_threads_bits(rows: int) -> None:
    _needs_kernel()
    lib = panel_linear.library()
    assert lib is not None
    if not lib.panel_threaded():
        pytest.skip("the kernel was built without OpenMP here")
    torch.manual_seed(rows)
    plain = nn.Linear(256, 200)
    panel = PanelLinear(plain)
    x = torch.randn(rows, 256)
    outs = []
    with torch.inference_mode():
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(panel(x))
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], nn.functional.linear(x, plain.weight, plain.bias),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_leading_dims_strided_rows_and_no_rows() -> None:
    _needs_kernel()
    torch.manual_seed(0)
    plain = nn.Linear(64, 48)
    panel = PanelLinear(plain)
    x3 = torch.randn(2, 3, 64)
    wide = torch.randn(9, 100)[:, 10:74]  # rows 100 apart: read in place
    with torch.inference_mode():
        torch.testing.assert_close(panel(x3), plain(x3), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(panel(wide), plain(wide), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(panel(wide.t().contiguous().t()), plain(wide))
        assert panel(torch.empty(0, 64)).shape == (0, 48)
    with pytest.raises(ValueError, match="PanelLinear"):
        panel(torch.randn(2, 63))
    with pytest.raises(ValueError, match="PanelLinear"):
        panel(torch.randn(2, 64, dtype=torch.float64))


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each output sums over k in order, so a row gives the same bits alone or among others."""
    _needs_kernel()
    torch.manual_seed(1)
    panel = PanelLinear(nn.Linear(256, 1024))
    x = torch.randn(13, 256)
    with torch.inference_mode():
        together = panel(x)
        for i in (0, 5, 6, 12):
            assert torch.equal(panel(x[i : i + 1]), together[i : i + 1])
            assert torch.equal(panel(x[: i + 1])[i], together[i])


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128, bias=False)
        self.inner = nn.ModuleList([nn.Linear(128, 128, bias=True) for _ in range(2)])
        self.down = nn.Linear(128, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for lin in self.inner:
            h = torch.relu(lin(h))
        return self.down(h)


def test_every_linear_of_a_model_is_replaced() -> None:
    _needs_kernel()
    torch.manual_seed(0)
    model = _Toy().eval()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = model(x)
    assert pack_panels(model, torch.float32, CPU) == 4
    assert not any(type(m) is nn.Linear for m in model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_nothing_is_packed_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "only fp32 on CPU" in str(why_not(torch.bfloat16, CPU))
    assert why_not(torch.float32, torch.device("cuda")) is not None
    monkeypatch.setenv("CHUNKSCOPE_PACKED_LINEAR", "0")  # else oneDNN's packing may come first
    if why_not(torch.float32, CPU) is None:  # the kernel applies here: at two threads too...
        torch.set_num_threads(2)
        assert why_not(torch.float32, CPU) is None
        panel_linear._state.clear()  # ...unless built without OpenMP
        with monkeypatch.context() as m:
            m.setattr(panel_linear.ckernel, "build_threaded", panel_linear.ckernel.build)
            assert "2 torch threads" in str(why_not(torch.float32, CPU))
        panel_linear._state.clear()
        torch.set_num_threads(1)
    monkeypatch.delenv("CHUNKSCOPE_PACKED_LINEAR")
    monkeypatch.setattr(panel_linear.ckernel, "x86_unavailable", lambda s, f: None)  # AVX-512
    monkeypatch.setattr(panel_linear.ckernel, "cpu_vendor", lambda: "GenuineIntel")
    assert "AVX-512" in str(why_not(torch.float32, CPU))  # MKL's fp32 GEMM on Intel
    monkeypatch.setattr(panel_linear.ckernel, "cpu_vendor", lambda: "AuthenticAMD")
    if torch.backends.mkldnn.is_available():  # oneDNN packs fp32 on other AVX-512 CPUs
        assert "oneDNN packs fp32" in str(why_not(torch.float32, CPU))
    monkeypatch.undo()
    monkeypatch.setenv("CHUNKSCOPE_PANEL_LINEAR", "0")
    model = _Toy().eval()
    assert why_not(torch.float32, CPU) == "CHUNKSCOPE_PANEL_LINEAR=0"
    assert pack_panels(model, torch.float32, CPU) == 0
    assert all(type(m) is nn.Linear for m in (model.up, model.down))


def test_a_panel_that_disagrees_keeps_the_plain_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _needs_kernel()
    real_forward = PanelLinear.forward

    def off(self: PanelLinear, x: torch.Tensor) -> torch.Tensor:
        return real_forward(self, x) * 1.001

    monkeypatch.setattr(PanelLinear, "forward", off)
    model = _Toy().eval()
    with caplog.at_level(logging.WARNING, logger=panel_linear.__name__):
        assert pack_panels(model, torch.float32, CPU) == 0
    assert "differs from the plain one" in caplog.text
    assert type(model.up) is nn.Linear


def test_engine_tokens_are_the_same_with_and_without_panels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _needs_kernel()
    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    def tokens(on: bool) -> list[list[int]]:
        monkeypatch.setenv("CHUNKSCOPE_PANEL_LINEAR", "1" if on else "0")
        engine = LLMEngine(
            EngineConfig(model="tiny", device="cpu", dtype="float32", token_budget=64,
                         max_model_len=512, cpu_threads=1)
        )  # fmt: skip
        kinds = {type(m).__name__ for m in engine.runner.model.modules()}
        assert ("PanelLinear" in kinds) is on and ("Linear" in kinds) is not on
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [list(range(3, 3 + n)) for n in (5, 90, 200)]
        ids = [engine.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished_requests():
            for o in engine.step().outputs:
                out[o.request_id].extend(o.new_token_ids)
        return [out[i] for i in ids]

    with_panels = tokens(True)
    assert all(len(t) == 12 for t in with_panels)
    assert with_panels == tokens(False)
