"""One request's raw measurements, as stored in the result JSON."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class RequestRecord:
    """Client-side timings: seconds; `*_wall` are time.time() stamps, the rest perf_counter
    intervals. Chunk times count only chunks that carry output text."""

    index: int
    traffic_class: str
    scheduled_s: float  # planned send offset after run start
    max_tokens: int
    planned_prompt_tokens: int
    num_images: int = 0
    endpoint: str = ""
    prompt_format: str = ""  # "ids" | "text" | "chat"
    status: str = "pending"  # "ok" | "error" | "pending"
    error: str | None = None
    http_status: int | None = None
    sent_s: float | None = None  # actual send offset after run start
    send_wall: float | None = None
    queue_s: float | None = None  # sent_s - scheduled_s (client-side queueing + lag)
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_wall: list[float] = field(default_factory=list)
    chunks: int = 0  # SSE data events received (all, including role/usage-only ones)
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage (or counted chunks if usage is missing)
    usage_present: bool = False
    finish_reason: str | None = None
    upload_bytes: int = 0
    server: dict[str, Any] | None = None  # the server's `chunkscope` block, if any
    meta: dict[str, Any] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        if self.status != "error":
            self.status, self.error = "error", reason

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
