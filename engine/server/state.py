"""What every handler needs: the engine client, metrics and limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.process.client import EngineClient
from engine.server.metrics import EngineMetrics
from engine.server.multimodal import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Images one request may carry (vLLM's --limit-mm-per-prompt '{"image": N}' is the convention).
DEFAULT_LIMIT_IMAGES_PER_PROMPT = 8


@dataclass
class ServerState:
    client: EngineClient
    metrics: EngineMetrics
    model_name: str
    engine_id: str
    control_token: str | None = None
    api_keys: tuple[bytes, ...] = ()  # SHA-256 of each --api-key (engine/server/auth.py)
    collector_url: str | None = None
    metrics_url: str | None = None  # this server's /metrics, told to the collector in the hello
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    limit_images_per_prompt: int = DEFAULT_LIMIT_IMAGES_PER_PROMPT
    started: float = field(default_factory=time.time)
