"""Per-request sampling parameters, validated when built.

The bounds are what the sampler runs without overflow or error, so one request's parameters
can never make the sampler raise. The HTTP API applies the same bounds (``engine/server/
protocol.py``) and the engine checks stop token ids against the vocabulary when it admits a
request (``engine/core/admission.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The smallest positive temperature. The sampler divides float32 logits by the temperature:
# at 0.01 a logit would have to exceed 3.4e36 in magnitude to overflow, while 1e-40 overflows
# any logit above about 3e-2. Below this floor the distribution is greedy in all but name, so
# ask for 0 instead. (vLLM raises smaller temperatures to the same floor.)
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# A seed seeds a ``torch.Generator``, which takes a 64-bit integer: the signed int64 range.
MIN_SEED = -(2**63)
MAX_SEED = 2**63 - 1
# ``top_k`` at or above the vocabulary size disables the filter; this bound only keeps the
# value a machine integer.
MAX_TOP_K = 2**31 - 1
# Stop token ids are checked after every sampled token: a short list.
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output tokens.

    ``temperature == 0`` means greedy; otherwise it is at least ``MIN_TEMPERATURE``.
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` (a signed 64-bit int)
    makes a sampled request reproducible regardless of what else is in the batch. At most
    ``MAX_STOP_TOKEN_IDS`` stop token ids. Anything else is a ValueError (TypeError for a
    value of the wrong type) naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"temperature must be a number, got {self.temperature!r}")
        t = self.temperature  # compared as is: float() of a huge int would overflow
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # also refuses NaN
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], "
                f"got {self.temperature}"
            )
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool):
            raise TypeError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 0 <= self.top_k <= MAX_TOP_K
        ):
            raise ValueError(
                f"top_k must be an int in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k!r}"
            )
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if not MIN_SEED <= self.seed <= MAX_SEED:
                raise ValueError(
                    f"seed must be in [{MIN_SEED}, {MAX_SEED}] (a signed 64-bit int), "
                    f"got {self.seed}"
                )
        ids = tuple(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID for t in ids
        ):
            raise ValueError(
                f"stop_token_ids must be token ids (ints in [0, {MAX_TOKEN_ID}]), "
                f"got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
