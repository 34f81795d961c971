"""The flash-attn backend (CUDA): the varlen kernel reading K/V in place through the block table."""

from __future__ import annotations

import torch

from engine.model.attention.common import (
    AttentionMetadata,
    SeqSlice,
    block_table,
    slot_mapping,
    store_kv,
)


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
        slots = slot_mapping(seqs, block_size)
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
