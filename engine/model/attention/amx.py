"""A bf16 attention kernel on AMX tiles for the paged cache (CPUs with AMX-BF16).

The C source next to this module (``amx_attention.c``) is compiled at first use with the system C
compiler into a cache folder keyed by the source's hash (``~/.cache/chunkscope/kernels``, or
``$CHUNKSCOPE_KERNEL_CACHE``), written under a temporary name and renamed into place so two
processes never load half a file, then loaded with ctypes and called with tensors' data
pointers (no torch headers, no build step at install time). ``prefix_kernel()`` returns None,
logging the reason once at INFO, when the kernel cannot be used: not x86-64 Linux, no AMX-BF16
in the CPU flags, ``CHUNKSCOPE_AMX_ATTENTION=0``, no compiler (``$CC``, else ``cc``) or a failed
build; the split backend then runs torch's flash kernel.

Two entry points on one core: ``attention_paged`` (what the split backend calls, once per layer)
takes a whole step, each sequence's query rows causally over its keys read through its block
table (16-key groups read in place when one stride apart, else copied); ``attention_prefix``
takes unmasked attention over a strided key range and returns the log-sum-exp too (benchmarks).
The core: for each K/V head, keys in chunks of 512 that stay in L2, and for each tile of 16
stacked query rows, pass 1 computes the chunk's scores on tiles (S^T = K Q^T, kept in L1) and
each row's max, pass 2 accumulates O^T += V^T exp(S^T - max) in tile registers; the running
output is rescaled once per chunk (online softmax). Causal: key blocks past a tile's last
position are skipped, only blocks that reach past its first position are masked. fp32
accumulation, P rounded to bf16 for the second product (as torch's bf16 flash kernel does).
Head dim 64 only; one thread.
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

SOURCE = Path(__file__).with_name("amx_attention.c")
FLAGS = ["-O3", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512bf16"]
HEAD_DIM = 64

_state: dict[str, object] = {}


def _why_not() -> str | None:
    """Why the AMX kernel cannot be used on this machine, or None."""
    return ckernel.x86_unavailable(
        "CHUNKSCOPE_AMX_ATTENTION", ("amx_tile", "amx_bf16", "avx512_bf16")
    )


def build(
    compiler: str | None = None, source_path: Path = SOURCE, flags: list[str] = FLAGS
) -> Path:
    """Compile a C source (by default this kernel's) into the kernel cache and return the
    library's path (``engine.model.ckernel.build``). Raises RuntimeError with the compiler's
    message when the build fails."""
    return ckernel.build(source_path, flags, compiler)


def _load() -> ctypes.CDLL | None:
    why = _why_not()
    if why is None:
        try:
            dll = ctypes.CDLL(str(build()))
            dll.amx_attention_prefix.restype = ctypes.c_int
            dll.amx_attention_prefix.argtypes = [
                ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
            ]  # fmt: skip
            dll.amx_attention_paged.restype = ctypes.c_int
            dll.amx_attention_paged.argtypes = [
                ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int,
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_float,
                ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
            ]  # fmt: skip
            if dll.amx_attention_init() != 0:
                why = "the kernel refused AMX tile data (arch_prctl XCOMP_PERM)"
            else:
                return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("AMX bf16 attention kernel not used: %s; torch's flash kernel runs instead", why)
    return None


def prefix_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (the reason logged once at INFO)."""
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded kernel (tests: re-run the availability check)."""
    _state.clear()


def usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel can run this call: bf16, head dim 64, one torch thread (the kernel
    is single-threaded; at head dim 128 or more threads the split backend gives the step to the
    AVX-512 kernel, which serves both), kernel built. A bf16 call it cannot take logs why,
    once."""
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return False
    why = None
    if q.shape[-1] != HEAD_DIM:
        why = f"head dim {q.shape[-1]} (the kernel has {HEAD_DIM} only)"
    elif torch.get_num_threads() != 1:
        why = f"{torch.get_num_threads()} torch threads (the kernel runs on one)"
    if why is not None:
        if why not in _state:
            _state[why] = True
            logger.info(
                "AMX bf16 attention kernel not used: %s; the AVX-512 kernel (attention/vec.py) "
                "or torch's flash kernel runs",
                why,
            )
        return False
    return prefix_kernel() is not None


def attention_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention without a mask of ``q`` ``[Hkv, R, 64]`` (rows of a K/V head's stacked query
    heads) over ``k``, ``v`` ``[N, Hkv, 64]`` (any row stride, the last dim contiguous), all
    bf16. Returns the output ``[Hkv, R, 64]`` and the natural log-sum-exp of the scaled
    scores ``[Hkv, R]``, both fp32. Call only when ``usable`` says so."""
    dll = prefix_kernel()
    if dll is None:
        raise RuntimeError("the AMX attention kernel is not available")
    heads, rows, dim = q.shape
    n = k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (heads, dim) or n < 1 or dim != HEAD_DIM:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or k.stride() != v.stride():
        raise ValueError("q, k, v need a contiguous last dim and k, v the same strides")
    out = torch.empty(heads, rows, dim, dtype=torch.float32)
    lse = torch.empty(heads, rows, dtype=torch.float32)
    rc = dll.amx_attention_prefix(
        q.data_ptr(), q.stride(0), q.stride(1), heads, rows,
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), n,
        dim, dim**-0.5 if scale is None else scale, out.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"amx_attention_prefix failed ({rc})")
    return out, lse


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
    """A step's attention read through the paged cache, written into ``out``: ``q`` and ``out``
    ``[T, Hq, 64]`` bf16; the caches ``[num_blocks, block_size, Hkv, 64]`` bf16 with the step's
    K/V already stored; ``seqs`` int32 ``[S, 3]`` (q_start, q_len, ctx_len) and ``table`` int64
    ``[S, W]`` (each sequence's block ids). Sequence ``s``'s query rows at positions
    ``[ctx_len - q_len, ctx_len)`` attend causally to its keys ``[0, ctx_len)`` in one online
    softmax (prefix and the chunk's own keys together; decodes are q_len 1); query head ``h``
    uses K/V head ``h // (Hq / Hkv)``. Rows of ``out`` not in any sequence are left as they
    are. Call only when ``usable`` says so. ``check_ranges=False`` skips the check of the rows
    and block ids against ``q`` and the cache (the split backend checks once per step, not once
    per layer: ~15 us a call)."""
    dll = prefix_kernel()
    if dll is None:
        raise RuntimeError("the AMX attention kernel is not available")
    seqs, table = check_paged_step(
        q, k_cache, v_cache, seqs, table, out, HEAD_DIM, (torch.bfloat16,), check_ranges
    )
    block_size, kv_heads, dim = k_cache.shape[1:]
    heads = q.shape[1]
    rc = dll.amx_attention_paged(
        q.data_ptr(), q.stride(0), q.stride(1), kv_heads, heads // kv_heads,
        seqs.shape[0], seqs.data_ptr(), table.data_ptr(), table.shape[1], block_size,
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(1), k_cache.stride(2),
        dim**-0.5 if scale is None else scale, out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"amx_attention_paged failed ({rc})")


def enabled() -> bool:
    """False when ``CHUNKSCOPE_AMX_ATTENTION=0`` (read when a backend is built)."""
    return os.environ.get("CHUNKSCOPE_AMX_ATTENTION", "1") != "0"
