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

Compiled at first use (``ckernel.build``, ``cc -O3 -mavx512f ... -fopenmp -DHEAD_DIM=D``), one
library per head dim (64 or 128), and loaded with ctypes. On CPUs with AVX2 + FMA but no
AVX-512 the same source builds with its intrinsics as pairs of 8-lane vectors
(``avx512_on_avx2.h``, ``cc -O3 -mavx2 -mfma``): the same results, but slower there than
torch's flash kernel (a 512-token chunk over 2,560 keys on one AMD EPYC core: 1.47x its time in
fp32, 1.25x in bf16), so it runs only when asked (``CHUNKSCOPE_VEC_ATTENTION=avx2``) and in the
tests, which so check the kernel's code on AVX2 machines (the CI's) too.
``kernel()`` returns None, the reason logged once at INFO, when it cannot be used: not x86-64
Linux, no AVX-512F/BW (AVX2 unless asked), ``CHUNKSCOPE_VEC_ATTENTION=0``, no compiler or a
failed build; the split backend then runs torch's flash kernel and the paged decode kernel.

Threads: the kernel shares a step out to ``torch.get_num_threads()`` threads (OpenMP, the
runtime torch itself uses: one pool), one job per (sequence, K/V head) and a chunk's query tiles
cut in as many ranges as threads. Built without OpenMP (a compiler without it) it runs only
with one torch thread. Head dim 64 or 128, at most 16 query heads per K/V head (``usable``).
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
ISA_FLAGS = {
    "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mfma"],
    "avx2": ["-O3", "-mavx2", "-mfma"],
}
ISA_FEATURES = {"avx512": ("avx512f", "avx512bw", "avx512dq"), "avx2": ("avx2", "fma")}
ENV_SWITCH = "CHUNKSCOPE_VEC_ATTENTION"
HEAD_DIMS = (64, 128)
MAX_GROUPS = 16  # query heads per K/V head
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_state: dict[object, object] = {}


def isa() -> str | None:
    """The build this CPU takes by default: ``avx512``, ``avx2`` where asked
    (``CHUNKSCOPE_VEC_ATTENTION=avx2``), else None."""
    if ckernel.x86_unavailable(ENV_SWITCH, ISA_FEATURES["avx512"]) is None:
        return "avx512"
    if os.environ.get(ENV_SWITCH) == "avx2":
        return "avx2" if ckernel.x86_unavailable(ENV_SWITCH, ISA_FEATURES["avx2"]) is None else None
    return None


def _load(head_dim: int, which: str | None) -> ctypes.CDLL | None:
    why = ckernel.x86_unavailable(ENV_SWITCH, ISA_FEATURES[which or "avx512"])
    if why is None and which is not None:
        try:
            flags = [*ISA_FLAGS[which], f"-DHEAD_DIM={head_dim}"]
            dll = ctypes.CDLL(str(ckernel.build_threaded(SOURCE, flags)))
            fn = dll.vec_attention_paged
            fn.restype = ctypes.c_int
            L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int  # noqa: E741, N806
            fn.argtypes = [
                I, P, L, L, I, I, I, P, P, L, I, P, P, L, L, ctypes.c_float, P, L, L, I,
            ]  # fmt: skip
            dll.vec_attention_threaded.restype = ctypes.c_int
            dll.vec_attention_head_dim.restype = ctypes.c_int
            if dll.vec_attention_head_dim() != head_dim:
                raise RuntimeError("the library's head dim differs")
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info(
        "AVX-512 chunk attention kernel (head dim %d) not used: %s; torch's flash kernel runs",
        head_dim,
        why,
    )
    return None


def kernel(head_dim: int = 64, which: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernel library for ``head_dim`` (64 or 128), or None (the reason logged once
    at INFO). ``which``: the build (``avx512``, ``avx2``; None: ``isa()``)."""
    if head_dim not in HEAD_DIMS:
        return None
    which = which or isa()
    key = (head_dim, which)
    if key not in _state:
        _state[key] = _load(head_dim, which)
    return _state[key]  # type: ignore[return-value]


def available() -> bool:
    """Whether this CPU takes the kernel (nothing is built)."""
    return isa() is not None


def threaded(head_dim: int = 64) -> bool:
    """Whether the kernel shares its work out to threads (built with OpenMP)."""
    dll = kernel(head_dim)
    return dll is not None and bool(dll.vec_attention_threaded())


def reset() -> None:
    """Forget the loaded kernel (tests: re-run the availability check)."""
    _state.clear()


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can take this layer's step: fp32 or bf16 (q and cache alike), head
    dim 64 or 128, at most 16 query heads per K/V head, built; with more than one torch thread
    only when built with OpenMP."""
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or q.device.type != "cpu":
        return False
    dim = q.shape[-1]
    if dim not in HEAD_DIMS:
        return False
    if q.shape[1] % k_cache.shape[2] or q.shape[1] // k_cache.shape[2] > MAX_GROUPS:
        return False
    if kernel(dim) is None:
        return False
    return torch.get_num_threads() == 1 or threaded(dim)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    scale: float | None = None,
    check_ranges: bool = True,
    threads: int | None = None,
    which: str | None = None,
) -> None:
    """A step's attention read through the paged cache, written into ``out``: ``q`` and
    ``out`` ``[T, Hq, D]``; the caches ``[num_blocks, block_size, Hkv, D]`` (D 64 or 128) with
    the step's K/V
    already stored, all of one dtype (fp32 or bf16); ``seqs`` int32 ``[S, 3]`` (q_start, q_len,
    ctx_len) and ``table`` int64 ``[S, W]`` (each sequence's block ids). Sequence ``s``'s query
    rows at positions ``[ctx_len - q_len, ctx_len)`` attend causally to its keys
    ``[0, ctx_len)`` (decodes are q_len 1); query head ``h`` uses K/V head ``h // (Hq / Hkv)``.
    Rows of ``out`` not in any sequence are left as they are. ``check_ranges=False`` skips the
    check of the rows and block ids (done once per step by the caller, not once per layer).
    ``threads``: how many threads share the work (None: torch's thread count); ``which``: the
    build (None: this CPU's, ``isa()``)."""
    dim = q.shape[-1]
    if dim not in HEAD_DIMS:
        raise ValueError(f"bad shapes or dtypes: head dim {dim} (the kernel has {HEAD_DIMS})")
    dll = kernel(dim, which)
    if dll is None:
        raise RuntimeError(f"the AVX-512 chunk attention kernel (head dim {dim}) is not available")
    seqs, table = check_paged_step(
        q, k_cache, v_cache, seqs, table, out, dim, tuple(_DTYPES), check_ranges
    )
    block_size, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    rc = dll.vec_attention_paged(
        _DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), kv_heads, heads // kv_heads,
        seqs.shape[0], seqs.data_ptr(), table.data_ptr(), table.shape[1], block_size,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2),
        dim**-0.5 if scale is None else scale, out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads() if threads is None else threads,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"vec_attention_paged failed ({rc})")


def enabled() -> bool:
    """False when ``CHUNKSCOPE_VEC_ATTENTION=0`` (read when a backend is built)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"
