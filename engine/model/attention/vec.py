"""A step's attention on AVX-512 FMA over the paged cache (CPUs with AVX-512 but no AMX).

On such CPUs the split backend's chunk attention was torch's flash kernel, whose two products
are MKL ``sgemm`` calls; on AMD CPUs MKL runs its AVX2 code there (~75 GFLOP/s on one Zen 5
core, where oneDNN's fp32 GEMM reaches ~215), and in bf16 the kernel is no faster. The C source
next to this module (``vec_attention.c``) takes each chunk in one online softmax over its prefix
and its own keys, reading K/V through the block table where they lie (fp32; a bf16 cache is
widened to fp32 256 keys at a time): no gather, no mask, no merge. fp32 arithmetic for both
dtypes (bf16 inputs are widened exactly, the output rounded to nearest even). Decodes take
their own path in the same call (a key row loaded once for the query heads that share it, a
score each by 4 FMAs and a horizontal sum): 16-row query tiles would leave most lanes idle, and
the plain-C decode kernel (``paged_decode``) took 127-156 us a layer for six ~230-token
sequences on the Zen 5 core, this path 35-38 us (fp32 and bf16).

Compiled at first use (``ckernel.build``, ``cc -O3 -mavx512f ...``) and loaded with ctypes.
``kernel()`` returns None, the reason logged once at INFO, when it cannot be used: not x86-64
Linux, no AVX-512F/BW, ``CHUNKSCOPE_VEC_ATTENTION=0``, no compiler or a failed build; the split
backend then runs torch's flash kernel and the paged decode kernel. Head dim 64, at most 16
query heads per K/V head and one torch thread only (``usable``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from engine.model import ckernel
from engine.model.attention.common import check_paged_step

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("vec_attention.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mfma"]
ENV_SWITCH = "CHUNKSCOPE_VEC_ATTENTION"
HEAD_DIM = 64
MAX_GROUPS = 16  # query heads per K/V head
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_state: dict[str, object] = {}


def _load() -> ctypes.CDLL | None:
    why = ckernel.x86_unavailable(ENV_SWITCH, ("avx512f", "avx512bw", "avx512dq"))
    if why is None:
        try:
            dll = ctypes.CDLL(str(ckernel.build(SOURCE, FLAGS)))
            fn = dll.vec_attention_paged
            fn.restype = ctypes.c_int
            L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int  # noqa: E741, N806
            fn.argtypes = [
                I, P, L, L, I, I, I, P, P, L, I, P, P, L, L, ctypes.c_float, P, L, L,
            ]  # fmt: skip
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("AVX-512 chunk attention kernel not used: %s; torch's flash kernel runs", why)
    return None


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (the reason logged once at INFO)."""
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded kernel (tests: re-run the availability check)."""
    _state.clear()


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can take this layer's step: fp32 or bf16 (q and cache alike), head
    dim 64, at most 16 query heads per K/V head, one torch thread (the kernel is
    single-threaded; torch's parallelizes), built."""
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or q.device.type != "cpu":
        return False
    if q.shape[-1] != HEAD_DIM or torch.get_num_threads() != 1:
        return False
    if q.shape[1] % k_cache.shape[2] or q.shape[1] // k_cache.shape[2] > MAX_GROUPS:
        return False
    return kernel() is not None


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    scale: float | None = None,
    check_ranges: bool = True,
) -> None:
    """A step's attention read through the paged cache, written into ``out``: ``q`` and
    ``out`` ``[T, Hq, 64]``; the caches ``[num_blocks, block_size, Hkv, 64]`` with the step's K/V
    already stored, all of one dtype (fp32 or bf16); ``seqs`` int32 ``[S, 3]`` (q_start, q_len,
    ctx_len) and ``table`` int64 ``[S, W]`` (each sequence's block ids). Sequence ``s``'s query
    rows at positions ``[ctx_len - q_len, ctx_len)`` attend causally to its keys
    ``[0, ctx_len)`` (decodes are q_len 1); query head ``h`` uses K/V head ``h // (Hq / Hkv)``.
    Rows of ``out`` not in any sequence are left as they are. ``check_ranges=False`` skips the
    check of the rows and block ids (done once per step by the caller, not once per layer)."""
    dll = kernel()
    if dll is None:
        raise RuntimeError("the AVX-512 chunk attention kernel is not available")
    seqs, table = check_paged_step(
        q, k_cache, v_cache, seqs, table, out, HEAD_DIM, tuple(_DTYPES), check_ranges
    )
    block_size, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    rc = dll.vec_attention_paged(
        _DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), kv_heads, heads // kv_heads,
        seqs.shape[0], seqs.data_ptr(), table.data_ptr(), table.shape[1], block_size,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2),
        dim**-0.5 if scale is None else scale, out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"vec_attention_paged failed ({rc})")


def enabled() -> bool:
    """False when ``CHUNKSCOPE_VEC_ATTENTION=0`` (read when a backend is built)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"
