"""Row-wise bf16 operations of the decoder step, each fused into one pass (CPUs with AVX512-BF16).

RMSNorm, rotary embedding and the MLP's ``silu(gate) * up`` run in torch as several
elementwise bf16 ops, each reading and writing the whole activation (~3 G elements/s on one
thread): at a 512-token chunk they cost about as much as the step's matmuls. The C source next
to this module (``fused_ops.c``) does each in one pass over a row, rounding to bf16 where
torch's sequence of ops does, so results are torch's up to fp32 summation order and the exp
inside silu. It is compiled at first use and loaded as the AMX attention kernel is
(``engine.model.ckernel.build``: same cache folder, same compiler, no build at install).

Used for bf16 CPU tensors with one torch thread (the loops are single-threaded; torch's ops
parallelize), when the CPU has AVX512-BF16 and the build succeeds; ``CHUNKSCOPE_FUSED_OPS=0``
turns them off. Otherwise ``llama.py`` runs its torch code, unchanged. The reason they are not
used is logged once at INFO.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from engine.model import ckernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_ops.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]

_state: dict[str, object] = {}
_switch = {"on": True}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def _why_not() -> str | None:
    return ckernel.x86_unavailable(
        "CHUNKSCOPE_FUSED_OPS", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    )


def _load() -> ctypes.CDLL | None:
    why = _why_not()
    if why is None:
        try:
            dll = ctypes.CDLL(str(ckernel.build(SOURCE, FLAGS)))
            dll.fused_rms_norm.argtypes = [_P, _L, _P, _I, _I, _F, _P, _L]
            dll.fused_rope.argtypes = [_P, _L, _I, _I, _I, _P, _P, _L]
            dll.fused_silu_mul.argtypes = [_P, _L, _I, _I, _P, _L]
            for f in (dll.fused_rms_norm, dll.fused_rope, dll.fused_silu_mul):
                f.restype = None
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("fused bf16 CPU ops not used: %s; torch's ops run instead", why)
    return None


def library() -> ctypes.CDLL | None:
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]  # type: ignore[return-value]


def reset() -> None:
    _state.clear()


def set_enabled(on: bool) -> None:
    """Turn the fused ops off or on again in this process (benchmarks alternate arms)."""
    _switch["on"] = on


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` (the step's activations) goes to the fused ops: bf16 on CPU, one torch
    thread, the library built."""
    return (
        _switch["on"]
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and torch.get_num_threads() == 1
        and library() is not None
    )


def _rows(x: torch.Tensor, n: int) -> int:
    """Row stride of a 2-D bf16 ``x`` whose rows hold ``n`` contiguous elements."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < n or n % 16:
        raise ValueError(f"bad layout: shape {tuple(x.shape)}, strides {x.stride()}, n {n}")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x.float()).to(bf16)`` of ``x`` ``[T, H]`` (H a multiple of 16)."""
    rows, n = x.shape
    if weight.shape != (n,) or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        raise ValueError(f"bad weight {tuple(weight.shape)} {weight.dtype} for hidden {n}")
    xs = _rows(x, n)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    library().fused_rms_norm(  # type: ignore[union-attr]
        x.data_ptr(), xs, weight.data_ptr(), rows, n, eps, out.data_ptr(), n
    )
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place on ``x`` ``[T, H, D]`` (heads contiguous within a row, D a
    multiple of 32) with ``cos``, ``sin`` ``[T, 1, D]`` bf16 (``RotaryEmbedding.tables``)."""
    rows, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 32:
        raise ValueError(f"bad layout: shape {tuple(x.shape)}, strides {x.stride()}")
    if cos.shape != (rows, 1, d) or sin.shape != cos.shape or cos.dtype != torch.bfloat16:
        raise ValueError(f"bad tables: {tuple(cos.shape)} {cos.dtype}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    library().fused_rope(  # type: ignore[union-attr]
        x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(), d
    )
    return x


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate_up`` ``[T, 2n]`` = ``[gate | up]`` (n a multiple of 16)."""
    rows = gate_up.shape[0]
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * n:
        raise ValueError(f"bad shape {tuple(gate_up.shape)} for intermediate {n}")
    gs = _rows(gate_up, 2 * n)
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    library().fused_silu_mul(  # type: ignore[union-attr]
        gate_up.data_ptr(), gs, rows, n, out.data_ptr(), n
    )
    return out
