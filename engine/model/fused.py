"""Row-wise operations of the decoder step, each fused into one pass (bf16 with AVX512-BF16,
fp32 on any CPU).

RMSNorm, rotary embedding and the MLP's ``silu(gate) * up`` run in torch as several
elementwise ops, each reading and writing the whole activation (~3 G elements/s on one thread
in bf16) and each a dispatch (at a decode step's few rows, the dispatches are the cost: torch's
fp32 RMSNorm of 6 x 256 takes ~47 us). The C sources next to this module do each in one pass
over a row: ``fused_ops.c`` for bf16 (AVX-512 intrinsics), rounding to bf16 where torch's
sequence of ops does, so results are torch's up to fp32 summation order and the exp inside silu;
``fused_ops_f32.c`` for fp32 (plain C for the vectorizer, ``-march=native``), torch's results
up to fp32 summation order and the exp. They are compiled at first use and loaded as the
attention kernels are (``engine.model.ckernel.build``: same cache folder, same compiler, no
build at install).

Used for bf16 (when the CPU has AVX512-BF16) and fp32 CPU tensors at any number of torch
threads: built with OpenMP (the runtime torch uses), each op shares its rows out to
``torch.get_num_threads()`` threads when it has at least 16,384 elements (one thread below: a
decode step's few rows); a compiler without OpenMP builds them single-threaded, and they then
serve one torch thread only. Used when the build succeeds;
``CHUNKSCOPE_FUSED_OPS=0`` turns them off. Otherwise ``llama.py`` runs its torch code,
unchanged. The reason they are not used is logged once at INFO.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from engine.model import ckernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_ops.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]  # and -fopenmp
SOURCE_F32 = Path(__file__).with_name("fused_ops_f32.c")
FLAGS_F32 = ["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math"]

_state: dict[str, object] = {}
_switch = {"on": True}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def _why_not() -> str | None:
    return ckernel.x86_unavailable(
        "CHUNKSCOPE_FUSED_OPS", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    )


def _load(source: Path, flags: list[str], prefix: str, why: str | None, what: str):  # type: ignore[no-untyped-def]
    """Build and load ``source``, whose three functions are named ``prefix`` + rms_norm, rope,
    silu_mul; None (the reason logged once at INFO) when ``why`` says it cannot run or the build
    fails."""
    if why is None:
        try:
            dll = ctypes.CDLL(str(ckernel.build_threaded(source, flags)))
            signatures = {
                "rms_norm": [_P, _L, _P, _I, _I, _F, _P, _L, _I],
                "rope": [_P, _L, _I, _I, _I, _P, _P, _L, _I],
                "silu_mul": [_P, _L, _I, _I, _P, _L, _I],
            }
            for name, argtypes in signatures.items():
                fn = getattr(dll, prefix + name)
                fn.argtypes, fn.restype = argtypes, None
            getattr(dll, prefix + "threaded").restype = _I
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("fused %s CPU ops not used: %s; torch's ops run instead", what, why)
    return None


def library() -> ctypes.CDLL | None:
    """The bf16 ops (AVX512-BF16 CPUs)."""
    if "dll" not in _state:
        _state["dll"] = _load(SOURCE, FLAGS, "fused_", _why_not(), "bf16")
    return _state["dll"]  # type: ignore[return-value]


def library_f32() -> ctypes.CDLL | None:
    """The fp32 ops (any CPU with a C compiler)."""
    if "f32" not in _state:
        off = os.environ.get("CHUNKSCOPE_FUSED_OPS", "1") == "0"
        why = "CHUNKSCOPE_FUSED_OPS=0" if off else None
        _state["f32"] = _load(SOURCE_F32, FLAGS_F32, "f32_", why, "fp32")
    return _state["f32"]  # type: ignore[return-value]


def reset() -> None:
    _state.clear()


def set_enabled(on: bool) -> None:
    """Turn the fused ops off or on again in this process (benchmarks alternate arms)."""
    _switch["on"] = on


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` (the step's activations) goes to the fused ops: bf16 or fp32 on CPU, the
    dtype's library built; more than one torch thread only when it was built with OpenMP."""
    if not (_switch["on"] and x.device.type == "cpu"):
        return False
    if x.dtype == torch.bfloat16:
        dll, prefix = library(), "fused_"
    elif x.dtype == torch.float32:
        dll, prefix = library_f32(), "f32_"
    else:
        return False
    if dll is None:
        return False
    return torch.get_num_threads() == 1 or bool(getattr(dll, prefix + "threaded")())


def _threads() -> int:
    return torch.get_num_threads()


def _rows(x: torch.Tensor, n: int) -> int:
    """Row stride of a 2-D ``x`` whose rows hold ``n`` contiguous elements."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < n or n % 16:
        raise ValueError(f"bad layout: shape {tuple(x.shape)}, strides {x.stride()}, n {n}")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_norm(x.float()).to(bf16)`` of a bf16 ``x`` ``[T, H]`` (H a multiple of 16);
    in fp32 ``weight * rms_norm(x)``."""
    rows, n = x.shape
    if weight.shape != (n,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"bad weight {tuple(weight.shape)} {weight.dtype} for hidden {n}")
    xs = _rows(x, n)
    out = torch.empty(rows, n, dtype=x.dtype)
    fn = library_f32().f32_rms_norm if x.dtype == torch.float32 else library().fused_rms_norm  # type: ignore[union-attr]
    fn(x.data_ptr(), xs, weight.data_ptr(), rows, n, eps, out.data_ptr(), n, _threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in place on ``x`` ``[T, H, D]`` (heads contiguous within a row, D a
    multiple of 32) with ``cos``, ``sin`` ``[T, 1, D]`` of its dtype (``RotaryEmbedding.tables``).
    """
    rows, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or d % 32:
        raise ValueError(f"bad layout: shape {tuple(x.shape)}, strides {x.stride()}")
    if cos.shape != (rows, 1, d) or sin.shape != cos.shape or cos.dtype != x.dtype:
        raise ValueError(f"bad tables: {tuple(cos.shape)} {cos.dtype}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    fn = library_f32().f32_rope if x.dtype == torch.float32 else library().fused_rope  # type: ignore[union-attr]
    fn(x.data_ptr(), x.stride(0), rows, heads, d, cos.data_ptr(), sin.data_ptr(), d, _threads())
    return x


def silu_mul(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate_up`` ``[T, 2n]`` = ``[gate | up]`` (n a multiple of 16)."""
    rows = gate_up.shape[0]
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * n:
        raise ValueError(f"bad shape {tuple(gate_up.shape)} for intermediate {n}")
    gs = _rows(gate_up, 2 * n)
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    f32 = gate_up.dtype == torch.float32
    fn = library_f32().f32_silu_mul if f32 else library().fused_silu_mul  # type: ignore[union-attr]
    fn(gate_up.data_ptr(), gs, rows, n, out.data_ptr(), n, _threads())
    return out
