"""Linear layers on CPU with their weights packed once for oneDNN: bf16 everywhere oneDNN
packs them, fp32 on non-Intel x86-64 CPUs with AVX-512.

bf16: ``nn.functional.linear`` in bf16 on CPU hands oneDNN the plain ``[out, in]`` weight at
every call, and oneDNN reorders it into its blocked (AMX / AVX512-BF16) layout each time: for a
decode step's few rows that reorder is most of the GEMM (a 6 x 256 x 1024 product: ~80 us plain,
~40 us packed on one thread of these Xeons). Packing once at load time
(``mkldnn._reorder_linear_weight``, the op Inductor's weight-prepacking pass uses) and calling
``mkldnn._linear_pointwise`` gives the same kernel on the same data, so the result is
bit-identical; only the reorder is gone. Wide prefill rows are no slower.

fp32: torch's fp32 ``linear`` on CPU goes to MKL's sgemm, which on AMD CPUs runs its AVX2 code:
~80-90 GFLOP/s at every size on one core of the 2-core AMD EPYC Zen 5 (AVX-512, no AMX) these
numbers come from (78 at 2048^3, 40-52 at 6 rows). oneDNN's fp32 kernels with the weight
packed the same way (the same two ops) ran 206-221 GFLOP/s at 506-2048 rows, 175-186 at 64
rows and ~77 at 6 rows, on [1024, 256] and [256, 512] weights, one torch thread. That is a
different kernel, so the results differ from ``linear``'s in fp32 summation order (max abs
~5e-5 on outputs of magnitude 16-25); each layer is checked on a probe within 1e-5 of the
largest value, as ``panel_linear`` is. On an Intel AVX-512 Xeon MKL's own kernels are wide and
an earlier session found the packed path no faster, so MKL stays there (and on CPUs without
AVX-512, where ``panel_linear``'s kernel serves the few-row case).

Batch invariance (fp32, oneDNN as in torch 2.13 on that CPU; a row computed within 1, 2..64,
500..519 and 1000-2048 rows against the same row within 512 or 2048 rows, one thread; 1..512
rows with two threads): every row count from 2 up gives a row the same bits. A single row
alone (m = 1) gives the same bits too when the reduction dimension k is at most 1024 (every
linear of the issue-20 model, hidden 256 and intermediate 512, and of the tiny preset); with k
above 1024 (e.g. the ``small`` preset's down_proj, k = 2048) oneDNN takes another path for one
row, and that row differs from the same row among others by ~5e-7 of the largest value. MKL's
``linear`` (what runs otherwise) is no better: with 1, 2 or 3 rows its results differ from the
same rows among 64 at every k tried (256-4096, 2e-7 to 7e-7 of the largest value).

When: bf16 or fp32 models on CPU, when torch has oneDNN and its weight-packing op; bf16 where
oneDNN packs bf16 weights (AVX512-BF16/AMX or AVX-NE-CONVERT); fp32 on x86-64 CPUs with
``avx512f`` whose vendor is not ``GenuineIntel``. Every layer is checked on a probe at packing
(a mismatch or a oneDNN refusal keeps the plain layer). ``CHUNKSCOPE_PACKED_LINEAR=0`` turns
both off.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from engine.model import ckernel
from engine.model.linear_swap import swap_linears

logger = logging.getLogger(__name__)

ENV_SWITCH = "CHUNKSCOPE_PACKED_LINEAR"
# oneDNN takes a batch-size hint when packing; decode steps (a few rows) are where packing pays
BATCH_HINT = 8
# the probe's tolerance, relative to the largest value: bf16 rounding of the output (one ulp);
# fp32 summation order (another kernel than MKL's)
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 1e-5}
INTEL = "GenuineIntel"


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives only in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        # an opaque mkldnn tensor: kept as a plain attribute, not a buffer (never moved or saved)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def why_not(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when packing applies to a model in ``dtype`` on ``device``; else the reason."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if device.type != "cpu" or dtype not in TOLERANCE:
        return f"only bf16 or fp32 on CPU (here {dtype} on {device.type})"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch has no mkldnn._reorder_linear_weight"
    if dtype == torch.float32:
        return fp32_refusal()
    return _cpu_refusal()


def fp32_refusal() -> str | None:
    """Whether fp32 weights are packed on this CPU: x86-64 with AVX-512, not Intel (see the
    module's docstring). None when they are; else the reason, MKL's GEMM kept."""
    why = ckernel.x86_unavailable(ENV_SWITCH, ("avx512f",))
    if why is not None:
        return f"{why}: MKL's fp32 GEMM kept"
    vendor = ckernel.cpu_vendor()
    if vendor is None:
        return "an unknown CPU vendor: MKL's fp32 GEMM kept"
    if vendor == INTEL:
        return "an Intel CPU: MKL's fp32 GEMM kept (oneDNN's packed fp32 measured no faster)"
    return None


_refusal: dict[str, str | None] = {}


def _cpu_refusal() -> str | None:
    """Whether oneDNN packs bf16 weights on this CPU at all (it needs AVX512-BF16/AMX or
    AVX-NE-CONVERT; on an AVX2-only CPU it refuses): tried once per process on a tiny layer."""
    if "cpu" not in _refusal:
        try:
            torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 1)
            _refusal["cpu"] = None
        except RuntimeError as exc:
            _refusal["cpu"] = f"oneDNN does not pack bf16 weights on this CPU ({exc})"
    return _refusal["cpu"]


def pack_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` when packing applies;
    returns how many were replaced (0, with the reason logged once, when it does not)."""
    reason = why_not(dtype, device)
    if reason is not None:
        logger.debug("linear weights not packed: %s", reason)
        return 0
    replaced = swap_linears(model, PackedLinear, TOLERANCE[dtype], "packed", logger)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    logger.info("%s linear weights packed for oneDNN: %d layers", name, replaced)
    return replaced
