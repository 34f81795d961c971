"""The SDPA backend: PyTorch scaled_dot_product_attention over K/V gathered from the cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from engine.model.attention.common import (
    AttentionMetadata,
    SeqSlice,
    block_table,
    context_slots,
    decode_groups,
    slot_mapping,
    store_kv,
)


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
            slot_mapping=slot_mapping(seqs, block_size).to(device),
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
        meta.decode_groups = decode_groups(decodes, table, block_size, device)
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
