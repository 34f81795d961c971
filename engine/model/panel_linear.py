"""fp32 linear layers on AVX2-class CPUs: weights packed once into 16-output panels, one C
kernel for every row count.

On these AMD EPYC machines (AVX2 + FMA, no AVX-512), torch's fp32 ``linear`` (MKL) is slow for
the few rows of a decode step: the 17 linears of the issue-20 model (hidden 256, 4 layers) take
~2.3 ms at 6 rows against ~0.33 ms at one row, while reading the same 9.7 MB of weights. The C
kernel next to this module (``panel_linear.c``) reads each weight once, in order, from a panel
layout packed at load time, and keeps a 6-row x 16-output block of sums in registers: 0.4-0.9
ms for the same 17 linears at 6 rows, and as fast as MKL at 512 rows (82 against 80 GFLOP/s),
so the plain weight is not kept (no second copy). Each output sums over k in order whatever the
batch: a row's result does not depend on the other rows.

Used for fp32 CPU models on x86-64 CPUs without AVX-512 (the kernel uses 8-float vectors; on
AVX-512 CPUs wider kernels serve: oneDNN's with packed weights on non-Intel ones,
``packed_linear``, and MKL's on Intel ones), when the library builds (``ckernel.build``,
``cc -O3 -march=native -fopenmp``).
``CHUNKSCOPE_PANEL_LINEAR=0`` turns it off. The results equal ``linear``'s
up to fp32 summation order (checked on a probe when each layer is packed). Threads: built with
OpenMP (the runtime torch uses), each call shares its panels out to ``torch.get_num_threads()``
threads, the same bits at any count; a compiler without OpenMP builds it single-threaded, and
the model is then packed only when loaded with one torch thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch
from torch import nn

from engine.model import ckernel, packed_linear
from engine.model.linear_swap import swap_linears

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_linear.c")
FLAGS = ["-O3", "-march=native"]  # and -fopenmp (ckernel.build_threaded)
ENV_SWITCH = "CHUNKSCOPE_PANEL_LINEAR"
PANEL = 16
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int

_state: dict[str, ctypes.CDLL | None] = {}


def _load() -> ctypes.CDLL | None:
    try:
        dll = ctypes.CDLL(str(ckernel.build_threaded(SOURCE, FLAGS)))
    except (RuntimeError, OSError) as e:
        logger.info("fp32 panel linear kernel not built (%s): torch's linear runs", e)
        return None
    dll.panel_pack.argtypes = [_P, _L, _I, _I, _P]
    dll.panel_linear.argtypes = [_P, _L, _I, _P, _I, _I, _P, _P, _L, _I]
    dll.panel_pack.restype = None
    dll.panel_linear.restype = _I
    dll.panel_threaded.restype = _I
    return dll


def library() -> ctypes.CDLL | None:
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]


class PanelLinear(nn.Module):
    """An fp32 ``nn.Linear`` whose weight lives only in the panel layout (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        lib = library()
        if lib is None:
            raise RuntimeError("the panel linear kernel is not available")
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.stride(1) != 1:
            raise ValueError(f"needs a CPU fp32 weight with contiguous rows, got {weight.dtype}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        n, k = self.out_features, self.in_features
        panels = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
        lib.panel_pack(weight.data_ptr(), weight.stride(0), n, k, panels.data_ptr())
        self.register_buffer("panels", panels, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous().clone()
        self.register_buffer("bias", bias, persistent=False)
        self._call = lib.panel_linear
        self._panels = panels.data_ptr()  # the buffers never move (CPU, inference only)
        self._bias = None if bias is None else bias.data_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(f"PanelLinear({k}, {n}) got {tuple(x.shape)} {x.dtype} {x.device}")
        rows = x if x.dim() == 2 else x.reshape(-1, k)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.float32)
        if m and self._call(rows.data_ptr(), rows.stride(0), m, self._panels, n, k, self._bias,
                            out.data_ptr(), n, torch.get_num_threads()):  # fmt: skip
            raise MemoryError("panel linear: scratch allocation failed")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panels=16"


def why_not(dtype: torch.dtype, device: torch.device) -> str | None:
    """None when panel packing applies to a model in ``dtype`` on ``device``; else the reason."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if device.type != "cpu" or dtype != torch.float32:
        return f"only fp32 on CPU (here {dtype} on {device.type})"
    if packed_linear.why_not(dtype, device) is None:  # the loader packs first: nothing left
        return "oneDNN packs fp32 weights on this CPU (packed_linear)"
    why = ckernel.x86_unavailable(ENV_SWITCH, ("avx2", "fma"))
    if why is not None:
        return why
    if ckernel.x86_unavailable(ENV_SWITCH, ("avx512f",)) is None:
        return "an AVX-512 CPU (MKL's wider kernels kept; the panel kernel uses 8-float vectors)"
    lib = library()
    if lib is None:
        return "the kernel did not build"
    if torch.get_num_threads() != 1 and not lib.panel_threaded():
        return f"{torch.get_num_threads()} torch threads (the kernel was built without OpenMP)"
    return None


def pack_panels(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PanelLinear` when it applies;
    returns how many were replaced (0, with the reason logged at DEBUG, when it does not)."""
    reason = why_not(dtype, device)
    if reason is not None:
        logger.debug("fp32 linear weights not packed into panels: %s", reason)
        return 0
    replaced = swap_linears(model, PanelLinear, 1e-5, "packed into panels", logger)
    logger.info("fp32 linear weights packed into panels: %d layers", replaced)
    return replaced
