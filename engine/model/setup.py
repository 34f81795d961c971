"""Building an engine's parts: device, dtype, model, KV cache size, vision encoder, scheduler,
runner and the limits a request is checked against."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.admission import RequestLimits
from engine.core.block_manager import BlockManager
from engine.core.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.model.arch import ModelArch
from engine.model.attention.select import select_backend
from engine.model.loader import load_model, resolve_model
from engine.model.runner import ModelRunner

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


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    model_name: str
    arch: ModelArch
    tokenizer: Any
    vision: torch.nn.Module | None
    max_model_len: int
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    limits: RequestLimits


def image_token_cost(vision: torch.nn.Module | None, arch: ModelArch) -> float:
    """What an image token should take from the budget: 1 + the encoder's multiply-adds per
    image token over the language model's per prompt token, from their weights (each image
    token is ``MERGE**2`` patches through the patch embedding and the blocks, then one merge;
    a prompt token goes through every weight but the embeddings and the head): 1.59 on the
    ``demo`` preset."""
    if vision is None:
        return 1.0
    from engine.model.vision import MERGE

    per_patch = sum(
        p.numel() for name, p in vision.named_parameters() if not name.startswith("merger")
    )
    merge = sum(p.numel() for name, p in vision.named_parameters() if name.startswith("merger"))
    lm = max(arch.num_params - 2 * arch.vocab_size * arch.hidden_size, arch.num_params // 2)
    return round(min(64.0, 1.0 + (MERGE * MERGE * per_patch + merge) / lm), 3)


def build_parts(config: EngineConfig, engine_id: str) -> EngineParts:
    """Load the model and build everything an engine steps with (``config`` is validated)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    source = resolve_model(config.model)
    arch = source.arch
    max_model_len = config.max_model_len or min(arch.max_position_embeddings, 32768)
    loaded = load_model(
        source, device=device, dtype=dtype, max_positions=max_model_len, seed=config.seed
    )
    tokenizer = loaded.tokenizer
    vision = build_vision(tokenizer.image_token_id, arch.hidden_size, config.seed, device, dtype)
    bs = config.block_size
    num_blocks = config.num_kv_blocks or default_num_blocks(
        config, arch, device, dtype, max_model_len, bs
    )
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    scheduler = Scheduler(
        block_manager,
        token_budget=config.token_budget,
        max_token_budget=config.max_token_budget,
        policy=config.policy,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        image_token_cost=config.image_token_cost or image_token_cost(vision, arch),
    )
    backend = select_backend(config.attention_backend, device, bs)
    runner = ModelRunner(
        loaded.model,
        num_blocks=num_blocks,
        block_size=bs,
        device=device,
        dtype=dtype,
        backend=backend,
        seed=config.seed,
        vision=vision,
    )
    logger.info(
        "engine %s: model %s (%.1fM params) on %s/%s, attention %s, %d KV blocks of %d, "
        "max_model_len %d",
        engine_id,
        loaded.name,
        arch.num_params / 1e6,
        device,
        dtype,
        backend.name,
        num_blocks,
        bs,
        max_model_len,
    )
    limits = RequestLimits(
        model_name=loaded.name,
        vocab_size=arch.vocab_size,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        block_size=bs,
        accepts_images=vision is not None,
        image_token_id=tokenizer.image_token_id,
        max_waiting=config.max_waiting,
    )
    return EngineParts(
        device=device,
        dtype=dtype,
        model_name=loaded.name,
        arch=arch,
        tokenizer=tokenizer,
        vision=vision,
        max_model_len=max_model_len,
        block_manager=block_manager,
        scheduler=scheduler,
        runner=runner,
        limits=limits,
    )
