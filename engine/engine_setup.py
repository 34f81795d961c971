"""Choices made once when an engine is built: device, dtype, KV cache size, vision encoder."""

from __future__ import annotations

import logging
import os

import torch

from engine.config import EngineConfig
from engine.model.arch import ModelArch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV cache on CPU: 2 GiB (or what fits max_model_len x 4)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def default_num_blocks(
    config: EngineConfig,
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    block_size: int,
) -> int:
    """KV blocks for ``kv_memory_fraction`` of the GPU's memory (0.9 by default) or, on CPU, of
    the host's memory (default: 2 GiB or 4 x max_model_len tokens, whichever is smaller)."""
    per_token = arch.kv_bytes_per_token(torch.finfo(dtype).bits // 8)
    if device.type == "cuda":
        fraction = config.kv_memory_fraction or 0.9
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * fraction) - (total - free)
    else:
        budget = (
            config.kv_memory_fraction
            and int(config.kv_memory_fraction * total_memory())
            or min(CPU_KV_CACHE_BYTES, max(4 * max_model_len, 65536) * per_token)
        )
    blocks = budget // (per_token * block_size)
    if blocks < -(-max_model_len // block_size):
        raise ValueError(
            f"the KV cache ({blocks} blocks of {block_size}) cannot hold one request of "
            f"max_model_len={max_model_len}: lower max_model_len or give more memory"
        )
    return int(blocks)


def build_vision(
    image_token_id: int | None,
    hidden: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.nn.Module | None:
    """The vision encoder, or None when the tokenizer has no image token (or no encoder is
    installed: image inputs are then refused)."""
    if image_token_id is None:
        return None
    try:
        from engine.model.vision import VisionEncoder
    except ImportError:
        logger.warning("no vision encoder available: image inputs are refused")
        return None
    with torch.device(device):
        enc = VisionEncoder(hidden, seed=seed)
    return enc.to(dtype).eval()


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
