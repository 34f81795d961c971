"""A Llama layer's element-wise pieces in C for one CPU thread: residual add + RMSNorm, SiLU x up,
rotary embedding.

On one thread torch runs each of these as several kernels over the step's rows, each a pass over
memory with bf16 widened and rounded at every op: at a 506-token chunk of the demo model's shape
(hidden 256) an RMSNorm costs ~190 us, SiLU x up ~280 us, the rotary embedding ~260 us (measured
here, bf16), ~4 ms of a ~45 ms chunk step over four layers. The C next to this module
(``cpu_ops.c``) does each in one pass, rounding to bf16 where torch's ops round, so bf16 results
match torch's to the bit but for an ulp where torch's vectorized exp or its summation order moves
an fp32 intermediate; fp32 within 1e-6.

Built like the attention kernels (``engine.model.ckernel``: first use, ``$CC`` else
``cc``, ``-O3 -march=native``), loaded with ctypes. :func:`step_ops` returns None, and the torch
expressions run, when the kernel cannot be used: not CPU, dtype other than fp32/bf16, more than
one torch thread (torch's kernels parallelize, these do not), ``CHUNKSCOPE_CPU_OPS=0``, no
compiler or a failed build (the reason logged once at INFO).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from engine.model import ckernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off"]
ENV_SWITCH = "CHUNKSCOPE_CPU_OPS"
MAX_HIDDEN = 65536
MAX_HEAD_DIM = 1024
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_state: dict[str, object] = {}


def _load() -> ctypes.CDLL | None:
    why = f"{ENV_SWITCH}=0" if os.environ.get(ENV_SWITCH, "1") == "0" else None
    if why is None:
        try:
            dll = ctypes.CDLL(str(ckernel.build(SOURCE, FLAGS)))
            I, L, P, F = ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_float  # noqa: E741, N806
            dll.add_rms_norm.argtypes = [I, P, L, P, L, P, F, P, L, L, I]
            dll.silu_mul.argtypes = [I, P, L, P, L, L, I]
            dll.rope_inplace.argtypes = [I, P, L, L, L, I, I, P, P, L]
            for fn in (dll.add_rms_norm, dll.silu_mul, dll.rope_inplace):
                fn.restype = ctypes.c_int
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("CPU element-wise kernels not used: %s; torch's ops run instead", why)
    return None


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (the reason logged once at INFO)."""
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded library (tests: re-run the availability check)."""
    _state.clear()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed ({rc})")


class CpuOps:
    """The kernels for one dtype; every tensor on CPU, that dtype, last dim contiguous."""

    def __init__(self, dll: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._dll = dll
        self.dtype = dtype
        self._code = _DTYPES[dtype]

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``h += delta`` in place (rounded to the dtype, as torch's add), then the normed
        ``weight * rms_norm(h)`` as a new ``[T, hidden]`` tensor (``RMSNorm.forward``'s
        numbers)."""
        rows, hidden = h.shape
        if (
            h.dtype != self.dtype
            or weight.dtype != self.dtype
            or weight.shape != (hidden,)
            or not weight.is_contiguous()
            or h.stride(1) != 1
            or hidden > MAX_HIDDEN
            or (delta is not None and (delta.shape != h.shape or delta.dtype != self.dtype))
            or (delta is not None and delta.stride(1) != 1)
        ):
            raise ValueError(
                f"add_rms_norm: h {tuple(h.shape)} {h.dtype}, weight {tuple(weight.shape)} "
                f"{weight.dtype}, delta {None if delta is None else tuple(delta.shape)}"
            )
        x = torch.empty(rows, hidden, dtype=self.dtype)
        _check(
            self._dll.add_rms_norm(
                self._code,
                h.data_ptr(),
                h.stride(0),
                None if delta is None else delta.data_ptr(),
                0 if delta is None else delta.stride(0),
                weight.data_ptr(),
                eps,
                x.data_ptr(),
                x.stride(0),
                rows,
                hidden,
            ),  # fmt: skip
            "add_rms_norm",
        )
        return x

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gu = [gate | up]`` ``[T, 2I]`` (``MLP.forward``'s numbers)."""
        rows, width = gu.shape
        if gu.dtype != self.dtype or width % 2 or gu.stride(1) != 1:
            raise ValueError(f"silu_mul: gu {tuple(gu.shape)} {gu.dtype}")
        out = torch.empty(rows, width // 2, dtype=self.dtype)
        _check(
            self._dll.silu_mul(
                self._code,
                gu.data_ptr(),
                gu.stride(0),
                out.data_ptr(),
                out.stride(0),
                rows,
                width // 2,
            ),  # fmt: skip
            "silu_mul",
        )
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary embedding applied to ``x`` ``[T, H, D]`` in place (``apply_rotary``'s
        numbers); ``cos``/``sin`` ``[T, 1, D]`` or ``[T, D]`` in the same dtype."""
        rows, heads, dim = x.shape
        if (
            x.dtype != self.dtype
            or cos.dtype != self.dtype
            or sin.dtype != self.dtype
            or x.stride(2) != 1
            or cos.shape[0] != rows
            or cos.shape[-1] != dim
            or cos.stride(-1) != 1
            or cos.stride() != sin.stride()
            or cos.shape != sin.shape
            or dim > MAX_HEAD_DIM
        ):
            raise ValueError(f"rope_: x {tuple(x.shape)} {x.dtype}, cos {tuple(cos.shape)}")
        _check(
            self._dll.rope_inplace(
                self._code,
                x.data_ptr(),
                x.stride(0),
                x.stride(1),
                rows,
                heads,
                dim,
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(0),
            ),  # fmt: skip
            "rope_inplace",
        )
        return x


def step_ops(h: torch.Tensor) -> CpuOps | None:
    """The kernels for a forward over ``h`` (the step's hidden states), or None where torch's
    ops must run (see the module docstring). Cheap: called once per step."""
    if h.device.type != "cpu" or h.dtype not in _DTYPES or torch.get_num_threads() != 1:
        return None
    key = f"ops-{h.dtype}"
    ops = _state.get(key)
    if ops is None:
        dll = library()
        if dll is None:
            return None
        ops = _state[key] = CpuOps(dll, h.dtype)
    return ops  # type: ignore[return-value]
