"""A Llama-family decoder written for a paged KV cache: one forward over a whole mixed batch.

Tokens of all sequences of a step are flattened into one ``[T]`` axis; attention is the only
place that needs to know where sequences begin and end (``AttentionMetadata``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model import fused
from engine.model.arch import ModelArch
from engine.model.attention.common import AttentionBackend, AttentionMetadata
from engine.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32, then scaled in the model's dtype; torch's fused rms_norm gives
        # the same bits as weight * (x * rsqrt(mean(x^2) + eps)), in one op
        if (
            x.dim() == 2
            and x.shape[1] % 16 == 0
            and self.weight.dtype == x.dtype
            and fused.usable(x)
        ):
            return fused.rms_norm(x, self.weight, self.eps)  # the same in one pass
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = nn.functional.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = arch.attention_bias
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``rope``: the step's cos and sin tables (``RotaryEmbedding.tables``)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.head_dim % 32 == 0 and fused.usable(q):  # in place on the fresh q, k views
            fused.rope_(q, *rope)
            fused.rope_(k, *rope)
        else:
            q, k = apply_rotary(q, k, *rope)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.intermediate % 16 == 0 and gate_up.dim() == 2 and fused.usable(gate_up):
            return self.down_proj(fused.silu_mul(gate_up, self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(
            arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        embed_rows: torch.Tensor | None = None,
        embed_values: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. ``embed_rows``/``embed_values``
        replace the token embeddings of those rows (image tokens)."""
        h = self.embed_tokens(input_ids)
        if embed_rows is not None and embed_values is not None:
            h = h.index_copy(0, embed_rows, embed_values.to(h.dtype))
        rope = self.rope.tables(positions, h.dtype)  # once per step, not per layer
        # the submodules' forward called directly: no hooks are used, and nn.Module.__call__
        # costs a few microseconds each, ~40 times per step (decode steps are ~1 ms of work)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = h + layer.self_attn.forward(
                layer.input_layernorm.forward(h), rope, kv, meta, backend
            )
            h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
        return self.norm.forward(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def init_synthetic(self, seed: int) -> None:
        """Seeded random weights (like vLLM's dummy load format), scaled so that activations
        and logits stay O(1) at any depth: same seed, same model, on any device."""
        device = self.embed_tokens.weight.device
        gen = torch.Generator(device=device).manual_seed(seed)
        depth_scale = 1.0 / math.sqrt(2 * max(1, self.arch.num_hidden_layers))
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=device))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen, device=device))
            else:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= depth_scale
                if name == "lm_head.weight":
                    std *= 3.0  # spread the logits: fewer near-ties under greedy decoding
                p.copy_(std * torch.randn(p.shape, generator=gen, device=device))
