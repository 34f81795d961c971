"""What every handler needs: the engine client, metrics and limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.process.client import EngineClient
from engine.server.metrics import EngineMetrics
from engine.server.multimodal import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerState:
    client: EngineClient
    metrics: EngineMetrics
    model_name: str
    engine_id: str
    control_token: str | None = None
    collector_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    started: float = field(default_factory=time.time)
