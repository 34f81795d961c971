"""Architecture hyper-parameters of a Llama-family decoder, and the named synthetic presets.

No torch here: the presets are plain data so `--help` and validation stay cheap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def with_(self, **changes: Any) -> ModelArch:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


BYTE_VOCAB = 260  # 256 bytes + BOS, EOS, image placeholder, pad
_BYTE_SPECIALS = {"bos_token_id": 256, "eos_token_id": 257}

PRESETS: dict[str, ModelArch] = {
    # Fast tests: every engine path in a few milliseconds per step.
    "tiny": ModelArch(
        vocab_size=BYTE_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **_BYTE_SPECIALS,
    ),
    # The CPU demo: sized (on 2 cores, fp32) so that an 8,000-token prefill step is far slower
    # than a decode step of 8 streams, which stays interactive (numbers in benchmarks/results/),
    # with the proportions of real models at 6-8k tokens: per-token (linear) work ~6,900 times
    # the work of one attention pair (Llama-3-8B: ~30,000; the earlier 384-wide demo: ~2,000,
    # where attention dominated and chunking could shrink a stall only ~L/2C instead of ~L/C).
    "demo": ModelArch(
        vocab_size=BYTE_VOCAB,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        **_BYTE_SPECIALS,
    ),
    # Shapes of real models, for GPUs (synthetic weights; real ones load from a local folder).
    "llama3.2-1b": ModelArch(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama3-8b": ModelArch(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}


def arch_from_hf_config(cfg: Any) -> ModelArch:
    """Build a ModelArch from a `transformers` config object (Llama or Mistral family)."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ("llama", "mistral"):
        raise ValueError(
            f"unsupported model_type {model_type!r}: chunkscope runs Llama-family decoders "
            "(model_type 'llama' or 'mistral')"
        )
    if getattr(cfg, "sliding_window", None):
        raise ValueError("sliding-window attention is not supported")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope_scaling = getattr(cfg, "rope_scaling", None)
    rope_params = getattr(cfg, "rope_parameters", None)
    theta = getattr(cfg, "rope_theta", None)
    if isinstance(rope_params, dict):
        theta = rope_params.get("rope_theta", theta)
        if rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if isinstance(rope_scaling, dict) and rope_scaling.get(
        "rope_type", rope_scaling.get("type")
    ) in (
        None,
        "default",
    ):
        rope_scaling = None
    eos = cfg.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelArch(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos,
    )
