"""Engine configuration: a dataclass with pure validation (loads nothing)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from wire.control import POLICIES

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "flex", "split")


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


@dataclass
class EngineConfig:
    """Everything the engine needs to start. ``validate()`` checks values without loading.

    ``model`` is a preset name (``tiny``, ``demo``, ``llama3-8b``, ...) or a local Hugging Face
    model folder. ``token_budget`` is the number of tokens one step may schedule;
    ``max_token_budget`` is the ceiling a live change may reach (buffers are never resized).
    ``long_prefill_token_threshold`` (0 = off) is the most prefill tokens one request may take
    in a step while other prompts wait for budget (see ``engine/core/scheduler.py``).
    ``num_kv_blocks`` fixes the KV cache size; otherwise ``kv_memory_fraction`` of the device's
    memory (GPU) or a default of 64 MiB-per-layer-scale heuristics (CPU) is used.
    ``cpu_threads`` is torch's intra-op thread count for the process that steps (None: torch's
    own choice, one per core); the server's engine core leaves one core to the HTTP side.
    """

    model: str = "tiny"
    token_budget: int = 512
    max_token_budget: int = 8192
    policy: str = "chunked"
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_memory_fraction: float | None = None
    max_num_seqs: int = 256
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    engine_id: str | None = None
    image_token_cap: int = 1280
    image_token_cost: float | None = None  # None: estimated from the vision encoder's size
    cpu_threads: int | None = None

    def validate(self) -> EngineConfig:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a preset name or a local model folder")
        _check_int("max_token_budget", self.max_token_budget, 1)
        _check_int("token_budget", self.token_budget, 1, self.max_token_budget)
        _check_int(
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            0,
            self.max_token_budget,
        )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        _check_int("block_size", self.block_size, 1, 4096)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(
                f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}"
            )
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_waiting", self.max_waiting, 1)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                "attention_backend must be auto, sdpa, flash, flex or split, "
                f"got {self.attention_backend!r}"
            )
        _check_int("image_token_cap", self.image_token_cap, 4)
        if self.image_token_cost is not None and not (
            isinstance(self.image_token_cost, int | float) and 1.0 <= self.image_token_cost <= 64.0
        ):
            raise ValueError(f"image_token_cost must lie in [1, 64], got {self.image_token_cost!r}")
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1, 1024)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
