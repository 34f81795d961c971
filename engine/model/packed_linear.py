"""bf16 linear layers on CPU with their weights packed once for oneDNN.

``nn.functional.linear`` in bf16 on CPU hands oneDNN the plain ``[out, in]`` weight at every
call, and oneDNN reorders it into its blocked (AMX / AVX512-BF16) layout each time: for a decode
step's few rows that reorder is most of the GEMM (a 6 x 256 x 1024 product: ~80 us plain, ~40 us
packed on one thread of these Xeons). Packing once at load time (``mkldnn._reorder_linear_weight``,
the op Inductor's weight-prepacking pass uses) and calling ``mkldnn._linear_pointwise`` gives the
same kernel on the same data, so the result is bit-identical; only the reorder is gone. Wide
prefill rows are no slower.

Only bf16 on CPU, and only when torch has oneDNN and the packed product matches the plain one on
a probe (checked once per layer at packing). ``CHUNKSCOPE_PACKED_LINEAR=0`` turns it off.
fp32 stays on ``linear``: there MKL's packed path measured no faster at these sizes.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from engine.model.linear_swap import swap_linears

logger = logging.getLogger(__name__)

ENV_SWITCH = "CHUNKSCOPE_PACKED_LINEAR"
# oneDNN takes a batch-size hint when packing; decode steps (a few rows) are where packing pays
BATCH_HINT = 8


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
    """None when packing applies; else the reason it does not."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"only bf16 on CPU (here {dtype} on {device.type})"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch has no mkldnn._reorder_linear_weight"
    return _cpu_refusal()


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
    # bf16 rounding of the output is the only difference allowed (one ulp of the largest value)
    replaced = swap_linears(model, PackedLinear, 2**-7, "packed", logger)
    logger.info("bf16 linear weights packed for oneDNN: %d layers", replaced)
    return replaced
