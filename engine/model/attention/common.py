"""Paged attention's shared plumbing: the step's metadata, block tables and slots, storing K/V.

Each backend (``sdpa``, ``flash``, ``flex``) is one module that imports this one; ``select``
picks one. Paged attention: store the step's new K/V into the cache, then attend.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout flash-attn's ``block_table`` API reads). ``prepare_metadata`` turns a step's chunk
layout into index tensors once per step; ``forward`` runs per layer and knows nothing about
scheduling. Every backend computes exactly what a one-shot prefill computes.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn.attention.bias import CausalBias

logger = logging.getLogger(__name__)


@dataclass
class SeqSlice:
    """One sequence of the step: query rows [q_start, q_start + q_len) at positions
    [ctx_len - q_len, ctx_len); it attends to positions [0, ctx_len)."""

    q_start: int
    q_len: int
    ctx_len: int
    block_ids: list[int]


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] query rows
    kv_slots: torch.Tensor  # [B, L] cache slots, padded
    mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is valid (None: no padding)


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    # each prefill chunk: its slice, its context's cache slots, its mask (None: plain causal)
    prefills: list[tuple[SeqSlice, torch.Tensor, torch.Tensor | CausalBias | None]] = field(
        default_factory=list
    )
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # flash-attn varlen inputs (built only for that backend)
    cu_seqlens_q: torch.Tensor | None = None
    seqused_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_table: torch.Tensor | None = None


def _long_tensor(values: array) -> torch.Tensor:
    """An int64 tensor over an ``array('q')`` (no copy: ~4x faster than ``torch.tensor`` of a
    list of a few hundred ints, which is per-step overhead here)."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(values, dtype=torch.long)


def block_table(seqs: list[SeqSlice], block_size: int) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` block ids of each sequence's context (padded with 0)."""
    width = max(-(-s.ctx_len // block_size) for s in seqs)
    flat = array("q")
    for s in seqs:
        n = -(-s.ctx_len // block_size)
        flat.extend(s.block_ids[:n])
        flat.extend([0] * (width - n))
    return _long_tensor(flat).view(len(seqs), width)


def context_slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for each row of ``table``: ``[rows, length]``."""
    offsets = torch.arange(block_size)
    return (table[:, :, None] * block_size + offsets).flatten(1)[:, :length]


def decode_groups(
    decodes: list[tuple[int, SeqSlice]],
    table: torch.Tensor,
    block_size: int,
    device: torch.device | None = None,
) -> list[DecodeGroup]:
    """Decodes ``(row in table, slice)`` in groups of similar context length (padding at most
    doubles the keys read per sequence), each with its gathered cache slots and, when lengths
    differ, a key-padding mask; tensors on ``device`` (None: CPU)."""
    decodes = sorted(decodes, key=lambda d: d[1].ctx_len, reverse=True)
    groups: list[DecodeGroup] = []
    i = 0
    while i < len(decodes):
        longest = decodes[i][1].ctx_len
        j = i
        while j < len(decodes) and decodes[j][1].ctx_len * 2 >= longest:
            j += 1
        group = decodes[i:j]
        slots = context_slots(table[[row for row, _ in group]], block_size, longest)
        lens = torch.tensor([s.ctx_len for _, s in group])
        mask = None
        if bool((lens < longest).any()):
            mask = (torch.arange(longest).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
            mask = mask.to(device) if device is not None else mask
        rows = torch.tensor([s.q_start for _, s in group], dtype=torch.long, device=device)
        groups.append(DecodeGroup(rows, slots.to(device) if device is not None else slots, mask))
        i = j
    return groups


def slot_mapping(seqs: list[SeqSlice], block_size: int) -> torch.Tensor:
    """Cache slot of every new token of the step, in batch order: ``[T]`` (one ``range`` per
    block a chunk touches: a decode step's handful of slots costs no tensor ops)."""
    out = array("q")
    for s in seqs:
        pos = s.ctx_len - s.q_len
        while pos < s.ctx_len:
            blk = pos // block_size
            end = min(s.ctx_len, (blk + 1) * block_size)
            shift = (s.block_ids[blk] - blk) * block_size  # position -> slot within this block
            out.extend(range(pos + shift, end + shift))
            pos = end
    return _long_tensor(out)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new K/V rows into their cache slots; return the caches as flat
    ``[num_slots, num_kv_heads, head_dim]`` views."""
    k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    return k_flat, v_flat


def check_paged_step(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    head_dim: int,
    dtypes: tuple[torch.dtype, ...],
    check_ranges: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The arguments of a whole-step attention kernel (``amx``, ``vec``), checked before their
    pointers go to C: ``q`` and ``out`` ``[T, Hq, head_dim]``, the caches ``[num_blocks,
    block_size, Hkv, head_dim]`` with one stride, all of one dtype in ``dtypes``, the last dims
    contiguous, ``Hq`` a multiple of ``Hkv``; ``seqs`` int32 ``[S, 3]`` (q_start, q_len,
    ctx_len) and ``table`` int64 ``[S, W]``; with ``check_ranges`` the query rows and block ids
    in range. Returns ``seqs`` and ``table`` contiguous; raises ValueError saying what is wrong
    (nothing is written)."""
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    if (
        q.dtype not in dtypes
        or not (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype)
        or v_cache.shape != k_cache.shape
        or k_cache.stride() != v_cache.stride()
        or dim != head_dim
        or q.dim() != 3
        or q.shape[2] != dim
        or q.shape[1] % kv_heads
        or out.shape != q.shape
        or q.stride(2) != 1
        or out.stride(2) != 1
        or k_cache.stride(3) != 1
        or k_cache.stride(0) != block_size * k_cache.stride(1)
    ):
        raise ValueError(
            f"bad shapes or dtypes: q {tuple(q.shape)} {q.dtype}, out {tuple(out.shape)} "
            f"{out.dtype}, cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if seqs.dtype != torch.int32 or table.dtype != torch.int64 or seqs.shape[0] != table.shape[0]:
        raise ValueError("seqs must be int32 [S, 3] and table int64 [S, W]")
    seqs, table = seqs.contiguous(), table.contiguous()
    if (
        check_ranges
        and seqs.numel()
        and (
            int(seqs[:, 0].min()) < 0
            or int((seqs[:, 0] + seqs[:, 1]).max()) > q.shape[0]
            or int(table.max()) >= num_blocks
            or int(table.min()) < 0
        )
    ):
        raise ValueError("query rows or block ids out of range")
    return seqs, table


class AttentionBackend(Protocol):
    name: str

    def prepare_metadata(
        self, seqs: list[SeqSlice], block_size: int, device: torch.device
    ) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...
