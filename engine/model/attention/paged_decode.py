"""Decode attention that reads the paged KV cache in place (CPU, fp32 and bf16).

A decode step's attention is one query per sequence against its whole context. Through torch
that is a gather of every sequence's K/V out of the cache (``index_select``, padded to the
group's longest) and then SDPA, whose flash kernel is built for long query blocks: at six
sequences of ~250 tokens the two cost ~0.5 ms per layer on one thread, for ~0.2 MFLOP of work.
The C kernel next to this module (``paged_decode.c``) follows each sequence's block table and
reads the keys and values where they lie, serving the query heads that share a K/V head
together: no gather, no padding, no mask.

It is plain C compiled at first use for the host (``ckernel.build``: ``cc -O3 -march=native
-fopenmp``), loaded with ctypes. ``decode_kernel()`` returns None, the reason logged once
at INFO, when it cannot be used: ``CHUNKSCOPE_DECODE_KERNEL=0``, no compiler, a failed build;
the split backend then runs its gather + SDPA path as before. Any head dim up to 256, any
number of torch threads: the (sequence, K/V head) pairs are shared out to
``torch.get_num_threads()`` threads (OpenMP, the runtime torch uses). A compiler without OpenMP
builds it single-threaded, and it then serves one torch thread only.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from engine.model import ckernel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]  # and -fopenmp (ckernel.build_threaded)
ENV_SWITCH = "CHUNKSCOPE_DECODE_KERNEL"
MAX_HEAD_DIM = 256
MAX_GROUP = 16
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_state: dict[str, object] = {}


def enabled() -> bool:
    """False when ``CHUNKSCOPE_DECODE_KERNEL=0``."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _load() -> ctypes.CDLL | None:
    why = None if enabled() else f"{ENV_SWITCH}=0"
    if why is None:
        try:
            dll = ctypes.CDLL(str(ckernel.build_threaded(SOURCE, FLAGS)))
            fn = dll.paged_decode_attention
            fn.restype = ctypes.c_int
            L, P, I = ctypes.c_long, ctypes.c_void_p, ctypes.c_int  # noqa: E741, N806
            fn.argtypes = [
                I, P, L, L, P, I, I, I, I, P, P, L, L, P, L, P, I, ctypes.c_float, P, L, L, I,
            ]  # fmt: skip
            dll.paged_decode_threaded.restype = ctypes.c_int
            return dll
        except (RuntimeError, OSError) as e:
            why = f"build or load failed: {e}"
    logger.info("paged decode attention kernel not used: %s; gather + SDPA runs instead", why)
    return None


def decode_kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (the reason logged once at INFO)."""
    if "dll" not in _state:
        _state["dll"] = _load()
    return _state["dll"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded kernel (tests: re-run the availability check)."""
    _state.clear()


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this layer's decodes: fp32 or bf16 on CPU, caches of the
    query's dtype, head dim and group size within the kernel's limits; more than one torch
    thread only when built with OpenMP."""
    if q.device.type != "cpu" or q.dtype not in _DTYPES or k_cache.dtype != q.dtype:
        return False
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[-2]
    if dim > MAX_HEAD_DIM or heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return False
    dll = decode_kernel()
    if dll is None:
        return False
    return torch.get_num_threads() == 1 or bool(dll.paged_decode_threaded())


def paged_decode(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    rows: torch.Tensor,
    block_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    scale: float | None = None,
    threads: int | None = None,
) -> None:
    """Write into ``out[rows[b]]`` (``[T, Hq, D]``) the attention of query ``q[rows[b]]``
    (``[T, Hq, D]``) over positions ``[0, ctx_lens[b])`` of its sequence, whose K/V live in
    ``k_flat``/``v_flat`` (``[slots, Hkv, D]``, slot = block id x ``block_size`` + offset) at
    the blocks of ``block_table[b]`` (int64 ``[B, W]``). ``rows``, ``ctx_lens``: int64 ``[B]``.
    ``threads``: how many threads share the work (None: torch's thread count). Call only when
    ``usable`` says so."""
    dll = decode_kernel()
    if dll is None:
        raise RuntimeError("the paged decode attention kernel is not available")
    num_seqs = rows.numel()
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_flat.shape[1]
    if (
        q.dtype not in _DTYPES
        or k_flat.dtype != q.dtype
        or v_flat.dtype != q.dtype
        or out.dtype != q.dtype
        or k_flat.shape != v_flat.shape
        or k_flat.shape[2] != dim
        or k_flat.stride() != v_flat.stride()
        or out.shape[1:] != q.shape[1:]
    ):
        raise ValueError(
            f"bad tensors: q {tuple(q.shape)} {q.dtype}, k {tuple(k_flat.shape)} {k_flat.dtype}, "
            f"v {tuple(v_flat.shape)}, out {tuple(out.shape)} {out.dtype}"
        )
    if q.stride(2) != 1 or k_flat.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, the caches and out need a contiguous last dim")
    for name, t in (("rows", rows), ("block_table", block_table), ("ctx_lens", ctx_lens)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor")
    if block_table.shape[0] != num_seqs or ctx_lens.shape != (num_seqs,):
        raise ValueError("rows, block_table and ctx_lens disagree on the number of sequences")
    if num_seqs == 0:
        return
    rc = dll.paged_decode_attention(
        _DTYPES[q.dtype], q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr(),
        num_seqs, heads, kv_heads, dim,
        k_flat.data_ptr(), v_flat.data_ptr(), k_flat.stride(0), k_flat.stride(1),
        block_table.data_ptr(), block_table.stride(0), ctx_lens.data_ptr(), block_size,
        dim**-0.5 if scale is None else scale,
        out.data_ptr(), out.stride(0), out.stride(1),
        torch.get_num_threads() if threads is None else threads,
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed ({rc})")
