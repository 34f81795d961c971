"""Paged attention: store the step's new K/V into the cache, then attend.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout flash-attn's ``block_table`` API reads). ``prepare_metadata`` turns a step's chunk
layout into index tensors once per step; ``forward`` runs per layer and knows nothing about
scheduling. Every backend computes exactly what a one-shot prefill computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

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


def block_table(seqs: list[SeqSlice], block_size: int) -> torch.Tensor:
    """``[num_seqs, max_blocks]`` block ids of each sequence's context (padded with 0)."""
    width = max(-(-s.ctx_len // block_size) for s in seqs)
    rows = [s.block_ids[: -(-s.ctx_len // block_size)] for s in seqs]
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)


def context_slots(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for each row of ``table``: ``[rows, length]``."""
    offsets = torch.arange(block_size)
    return (table[:, :, None] * block_size + offsets).flatten(1)[:, :length]


def slot_mapping(seqs: list[SeqSlice], table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of every new token of the step, in batch order: ``[T]``."""
    q_lens = torch.tensor([s.q_len for s in seqs])
    starts = torch.tensor([s.ctx_len - s.q_len for s in seqs])
    rows = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)
    first_row = torch.cumsum(q_lens, 0) - q_lens
    pos = torch.arange(int(q_lens.sum())) - first_row[rows] + starts[rows]
    return table[rows, pos // block_size] * block_size + pos % block_size


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


class SdpaBackend:
    """PyTorch scaled_dot_product_attention over K/V gathered from the paged cache.

    Prefill chunks attend one sequence at a time (a causal mask offset by the chunk's start);
    decodes are batched in groups of similar context length, padded and masked.

    A chunk that starts after position 0 needs a causal mask aligned to the bottom right. On
    CUDA (``lower_right=None``) that is ``torch.nn.attention.bias.causal_lower_right``, which SDPA
    hands to a fused kernel (flash or memory-efficient) instead of materialising a
    ``[q_len, ctx_len]`` mask; those kernels want as many K/V heads as query heads, so the
    chunk's K/V heads are repeated for it. On CPU the dense boolean mask, built once per step,
    is cheaper. ``lower_right=True`` forces the fused-kernel form anywhere (tests compare both).
    """

    name = "sdpa"

    def __init__(self, lower_right: bool | None = None) -> None:
        self.lower_right = lower_right

    def prepare_metadata(
        self, seqs: list[SeqSlice], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        table = block_table(seqs, block_size)
        meta = AttentionMetadata(
            num_tokens=sum(s.q_len for s in seqs),
            slot_mapping=slot_mapping(seqs, table, block_size).to(device),
        )
        decodes: list[tuple[int, SeqSlice]] = []
        for row, s in enumerate(seqs):
            if s.q_len == 1:
                decodes.append((row, s))
                continue
            kv = context_slots(table[row : row + 1], block_size, s.ctx_len)[0]
            start = s.ctx_len - s.q_len
            mask: torch.Tensor | CausalBias | None = None
            lower_right = device.type == "cuda" if self.lower_right is None else self.lower_right
            if start > 0 and lower_right:
                mask = causal_lower_right(s.q_len, s.ctx_len)
            elif start > 0:
                q_pos = torch.arange(start, s.ctx_len).unsqueeze(1)
                mask = (torch.arange(s.ctx_len).unsqueeze(0) <= q_pos).to(device)
            meta.prefills.append((s, kv.to(device), mask))
        # Group decodes so that padding at most doubles the keys read per sequence.
        decodes.sort(key=lambda d: d[1].ctx_len, reverse=True)
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
                mask = mask.to(device)
            rows = torch.tensor([s.q_start for _, s in group], dtype=torch.long, device=device)
            meta.decode_groups.append(DecodeGroup(rows, slots.to(device), mask))
            i = j
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat, v_flat = store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for s, kv_slots, mask in meta.prefills:
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1).unsqueeze(0)
            ks = k_flat.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)
            vs = v_flat.index_select(0, kv_slots).transpose(0, 1).unsqueeze(0)
            if isinstance(mask, CausalBias):
                # fused kernels take the bias with equal head counts (no enable_gqa on every
                # torch version): repeat each K/V head for its query heads
                groups = qs.shape[1] // ks.shape[1]
                ks = ks.repeat_interleave(groups, dim=1)
                vs = vs.repeat_interleave(groups, dim=1)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            else:
                o = F.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, is_causal=mask is None, enable_gqa=True
                )
            out[s.q_start : s.q_start + s.q_len] = o.squeeze(0).transpose(0, 1)
        for g in meta.decode_groups:
            qs = q.index_select(0, g.rows).unsqueeze(2)  # [B, Hq, 1, D]
            shape = (*g.kv_slots.shape, num_kv_heads, head_dim)
            flat_slots = g.kv_slots.reshape(-1)
            ks = k_flat.index_select(0, flat_slots).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
            vs = v_flat.index_select(0, flat_slots).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=g.mask, enable_gqa=True)
            out.index_copy_(0, g.rows, o.squeeze(2))
        return out


class FlashAttnBackend:
    """flash-attn's ``flash_attn_varlen_func`` reading K/V straight from the paged cache through
    ``block_table`` (bottom-right aligned causal mask, so a chunk sees its whole prefix)."""

    name = "flash"

    def __init__(self) -> None:
        self._func = import_flash_attn()

    def prepare_metadata(
        self, seqs: list[SeqSlice], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        table = block_table(seqs, block_size)
        slots = slot_mapping(seqs, table, block_size)
        cu_q = torch.tensor([0] + [s.q_len for s in seqs], dtype=torch.int32).cumsum(0)
        return AttentionMetadata(
            num_tokens=int(cu_q[-1]),
            slot_mapping=slots.to(device),
            cu_seqlens_q=cu_q.to(torch.int32).to(device),
            seqused_k=torch.tensor([s.ctx_len for s in seqs], dtype=torch.int32, device=device),
            max_seqlen_q=max(s.q_len for s in seqs),
            max_seqlen_k=max(s.ctx_len for s in seqs),
            block_table=table.to(torch.int32).to(device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        assert meta.seqused_k is not None and meta.cu_seqlens_q is not None
        cu_k = torch.nn.functional.pad(meta.seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
        return self._func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            causal=True,
            block_table=meta.block_table,
        )


FLASH_INSTALL_HINT = (
    "pip install 'chunkscope[gpu]'  (or: pip install flash-attn --no-build-isolation)"
)


def import_flash_attn():  # type: ignore[no-untyped-def]
    """Import flash-attn's varlen kernel or fail with the install command."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(f"flash-attn is not installed: {FLASH_INSTALL_HINT}") from exc
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    try:
        import_flash_attn()
    except ImportError:
        return False
    return True


def select_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """``auto``: flash-attn on CUDA when it imports and the block size suits it, else SDPA.
    ``flex``: FlexAttention over the paged cache (engine/model/attention/flex.py)."""
    if name == "sdpa" or (name == "auto" and device.type != "cuda"):
        return SdpaBackend()
    if name == "flex":
        from engine.model.attention.flex import FlexBackend  # imports torch.compile machinery

        return FlexBackend(device, block_size)
    if name == "flash":
        if device.type != "cuda":
            raise ValueError("the flash attention backend needs a CUDA device")
        if block_size % 256:
            raise ValueError(f"flash-attn's paged KV needs block_size % 256 == 0, got {block_size}")
        return FlashAttnBackend()
    if flash_attn_available() and block_size % 256 == 0:
        return FlashAttnBackend()
    if flash_attn_available():
        logger.warning(
            "flash-attn found but block_size=%d is not a multiple of 256: SDPA", block_size
        )
    return SdpaBackend()
