"""A small synthetic vision encoder in the Qwen2-VL shape: 14x14 patches, 2x2 merge.

``VisionEncoder(hidden)(pixels)`` takes one image as uint8 ``[H, W, 3]`` (H and W multiples of
28) and returns ``[(H // 28) * (W // 28), hidden]`` embeddings, one per image token, in row-major
order of the merged grid. Weights are synthetic and seeded (deterministic for a given seed and
independent of the global RNG): the point is realistic compute and shapes, not meaning.

Attention is local, as in Qwen2.5-VL's windowed layers: patches attend within a *band* of
``band_rows`` merged-token rows across the image's width, so bands are independent and an image
can be encoded band by band: ``encode_bands(pixels, first, last)`` gives the tokens of bands
``[first, last)``, and ``forward`` is every band in turn (the same per-band computation, so the
two agree bit for bit). The engine encodes, with each prefill chunk, only the bands that chunk's
image tokens need: the encoder's work is chunked with the prompt and bounded by the token budget
(a whole-image encoder would run an image's encoder in one step at any budget).

Cost: the width defaults to half the language model's hidden size (at most 512). On the ``demo``
preset a 720p image (1,196 tokens) encodes in about 170 ms on 2 CPU cores, against about 220 ms
for the language model's prefill of as many tokens: the same order as in Qwen2-VL (a 675 M ViT
over 4 patches per token beside a 7.6 B language model), where the encoder is the smaller part.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MERGE = 2
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _sincos_2d(gh: int, gw: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 2D sin-cos position embeddings ``[gh * gw, dim]`` (any grid size, no weights)."""
    quarter = dim // 4
    freqs = 1.0 / (10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter))
    ys = torch.arange(gh, device=device, dtype=torch.float32)[:, None] * freqs[None]
    xs = torch.arange(gw, device=device, dtype=torch.float32)[:, None] * freqs[None]
    ys = ys[:, None, :].expand(gh, gw, quarter)
    xs = xs[None, :, :].expand(gh, gw, quarter)
    pos = torch.cat([ys.sin(), ys.cos(), xs.sin(), xs.cos()], dim=-1).reshape(gh * gw, -1)
    if pos.shape[1] < dim:
        pos = F.pad(pos, (0, dim - pos.shape[1]))
    return pos


class _Block(nn.Module):
    """Pre-norm transformer block over the patch sequence (bidirectional SDPA)."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, width = x.shape
        head_dim = width // self.num_heads
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, head_dim).unbind(1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        )  # [heads, n, head_dim]
        x = x + self.proj(attn.transpose(0, 1).reshape(n, width))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionEncoder(nn.Module):
    """Patch embedding → transformer blocks → 2x2 patch merge MLP → ``hidden_size``."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_layers: int = 2,
        patch_size: int = 14,
        seed: int = 0,
        width: int | None = None,
        band_rows: int = 1,
    ) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if num_layers < 0:
            raise ValueError(f"num_layers must be >= 0, got {num_layers}")
        if patch_size < 1:
            raise ValueError(f"patch_size must be positive, got {patch_size}")
        if band_rows < 1:
            raise ValueError(f"band_rows must be positive, got {band_rows}")
        self.hidden_size = hidden_size
        self.patch_size = patch_size
        self.factor = patch_size * MERGE
        self.band_rows = band_rows
        width = width if width is not None else max(32, min(hidden_size // 2, 512))
        num_heads = max(1, width // 64)
        if width % num_heads:
            raise ValueError(f"vision width {width} must divide into {num_heads} heads")
        self.width = width
        self.patch_embed = nn.Linear(3 * patch_size * patch_size, width)
        self.blocks = nn.ModuleList(_Block(width, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width)
        merged = width * MERGE * MERGE
        self.merger = nn.Sequential(
            nn.LayerNorm(merged),
            nn.Linear(merged, merged),
            nn.GELU(),
            nn.Linear(merged, hidden_size),
        )
        self.register_buffer("mean", torch.tensor(CLIP_MEAN) * 255.0, persistent=False)
        self.register_buffer("std", torch.tensor(CLIP_STD) * 255.0, persistent=False)
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.ndim == 1:  # LayerNorm weight
                param.fill_(1.0)
            else:
                std = 1.0 / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    def num_tokens(self, height: int, width: int) -> int:
        return (height // self.factor) * (width // self.factor)

    def band_tokens(self, width: int) -> int:
        """Image tokens per band of an image ``width`` pixels wide (the last band may hold
        fewer)."""
        return self.band_rows * (width // self.factor)

    def num_bands(self, height: int) -> int:
        return -(-(height // self.factor) // self.band_rows)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.encode_bands(pixels, 0, self.num_bands(int(pixels.shape[0])))

    def encode_bands(self, pixels: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """The image tokens of bands ``[first, last)``: ``[tokens, hidden]``, row-major."""
        if pixels.ndim != 3 or pixels.shape[2] != 3:
            raise ValueError(f"pixels must be [H, W, 3], got {tuple(pixels.shape)}")
        height, width = int(pixels.shape[0]), int(pixels.shape[1])
        if height % self.factor or width % self.factor or height == 0 or width == 0:
            raise ValueError(
                f"image size {width}x{height} must be positive multiples of {self.factor}; "
                "resize it with engine.server.multimodal.resize_image"
            )
        bands = self.num_bands(height)
        if not 0 <= first < last <= bands:
            raise ValueError(f"bands [{first}, {last}) outside the image's {bands} bands")
        p = self.patch_size
        gh, gw = height // p, width // p
        pos = _sincos_2d(gh, gw, self.width, self.device)
        rows = MERGE * self.band_rows  # patch rows per band
        out = []
        for band in range(first, last):
            r0, r1 = band * rows, min(gh, (band + 1) * rows)
            out.append(self._band(pixels[r0 * p : r1 * p], pos[r0 * gw : r1 * gw], gw))
        return torch.cat(out)

    def _band(self, pixels: torch.Tensor, pos: torch.Tensor, gw: int) -> torch.Tensor:
        """One band: its pixel rows ``[rows * p, W, 3]`` and the position embeddings of its
        patches; attention sees only the band's patches."""
        p = self.patch_size
        gh = int(pixels.shape[0]) // p
        x = pixels.to(device=self.device, dtype=torch.float32)
        x = (x - self.mean) / self.std
        # [h, W, 3] → [gh, p, gw, p, 3] → [gh, gw, p, p, 3] → patches [gh*gw, 3*p*p]
        x = x.view(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        x = self.patch_embed(x.to(self.dtype))
        x = x + pos.to(x.dtype)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        # 2x2 merge: [gh, gw, w] → [gh/2, 2, gw/2, 2, w] → [gh/2, gw/2, 2, 2, w] → [n, 4w]
        mh, mw = gh // MERGE, gw // MERGE
        x = x.view(mh, MERGE, mw, MERGE, self.width).permute(0, 2, 1, 3, 4)
        x = x.reshape(mh * mw, MERGE * MERGE * self.width)
        return self.merger(x)
