"""What the engine hands out: per-request outputs and stats snapshots. Torch-free (they cross
the process boundary between the engine core and the HTTP server)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    token_times: list[float]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_image_tokens: int
    num_cached_tokens: int
    traffic_class: str | None
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    step: int
    token_budget: int
    policy: str
    long_prefill_token_threshold: int = 0
