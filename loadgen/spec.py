"""What one request will be: its class, send offset, prompt segments or images, output length."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from loadgen.tokens import Segment

logger = logging.getLogger(__name__)


class ImageRef(NamedTuple):
    width: int
    height: int
    fmt: str  # "png" | "jpeg"
    variant: int


@dataclass
class RequestSpec:
    """One planned request. Completions use `segments`; chat completions use `images`+`text`."""

    index: int
    traffic_class: str
    offset_s: float  # scheduled send time, seconds after the run starts
    max_tokens: int
    segments: tuple[Segment, ...] = ()
    images: tuple[ImageRef, ...] = ()
    text: str = ""  # VLM instruction
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return bool(self.images) or bool(self.text)

    @property
    def prompt_len(self) -> int:
        """Planned prompt tokens (token-id prompts); 0 for chat-completion requests."""
        return sum(s.length for s in self.segments)


def fit_context(prompt_len: int, output: int, ctx: int, min_prompt: int = 1) -> tuple[int, int]:
    """(prompt budget, output) so that prompt + output <= ctx; output shrinks to leave room for
    at least `min_prompt` prompt tokens, then the prompt is cut to the rest."""
    ctx = max(ctx, min_prompt + 1)
    output = max(1, min(output, ctx - min_prompt))
    return min(prompt_len, ctx - output), output


def reindex(specs: list[RequestSpec]) -> list[RequestSpec]:
    """Sort by send offset (stable) and number 0..n-1."""
    specs.sort(key=lambda s: s.offset_s)
    for i, s in enumerate(specs):
        s.index = i
    return specs
