"""Which attention backend a model runs with (``--attention-backend``)."""

from __future__ import annotations

import logging

import torch

from engine.model.attention.common import AttentionBackend
from engine.model.attention.flash import FlashAttnBackend, flash_attn_available
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.split import SplitBackend, split_available

logger = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """``auto``: on CPU the split backend (engine/model/attention/split.py) when torch has its
    kernel, else SDPA; on CUDA flash-attn when it imports and the block size suits it, else SDPA.
    ``sdpa``: SDPA over gathered K/V with an offset mask (the plain-PyTorch path, any device).
    ``flex``: FlexAttention over the paged cache (engine/model/attention/flex.py)."""
    if name == "split":
        if device.type != "cpu":
            raise ValueError("the split attention backend runs on CPU only")
        return SplitBackend()
    if name == "auto" and device.type == "cpu":
        if split_available():
            return SplitBackend()
        logger.warning("torch has no fused CPU flash kernel with log-sum-exp: SDPA")
        return SdpaBackend()
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
