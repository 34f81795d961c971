"""What a request must satisfy to be queued: one set of checks for the engine and its client.

Torch-free, so the HTTP server process (a thin client of an engine core in another process)
checks requests with the limits the engine reported, and the engine checks them again itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting`` requests already; retry later."""


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits on one request (fixed once the engine is built)."""

    model_name: str
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    accepts_images: bool
    image_token_id: int | None
    max_waiting: int


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    images: list[Any] | None,
    limits: RequestLimits,
) -> list[int]:
    """The prompt as a list, or TypeError / ValueError saying what to change."""
    if not isinstance(params, SamplingParams):
        raise TypeError("params must be a SamplingParams")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    vocab = limits.vocab_size
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}), got {t!r}")
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"stop_token_ids must be ids in [0, {vocab}), got {bad}")
    total = len(prompt) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context of {limits.max_model_len} tokens"
        )
    needed = -(-total // limits.block_size)
    if needed > limits.num_kv_blocks:
        raise ValueError(
            f"this request needs {needed} KV blocks but the whole cache has "
            f"{limits.num_kv_blocks}: shorten the prompt or max_tokens"
        )
    if images and not limits.accepts_images:
        raise ValueError(f"model {limits.model_name!r} does not accept images")
    image_id = limits.image_token_id
    if not images and image_id is not None and image_id in prompt:
        raise ValueError("prompt contains image placeholder tokens but no images were given")
    return prompt


def check_queue(num_waiting: int, limits: RequestLimits) -> None:
    """QueueFullError when ``num_waiting`` requests already wait."""
    if num_waiting >= limits.max_waiting:
        raise QueueFullError(
            f"{num_waiting} requests are waiting (max_waiting={limits.max_waiting})"
        )
