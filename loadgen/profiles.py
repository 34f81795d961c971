"""Traffic profiles: one visible dataclass of defaults per class, overridable with `--set`.

Defaults and their sources (public traces):

- chat: Azure LLM inference trace 2023, conversation (Azure/AzurePublicDataset, CC-BY-4.0):
  input p50 1,020 / p90 2,734 tokens, output p50 129, arrivals close to Poisson. We model the
  user turn as lognormal(median 800, p90 3,000) behind a shared 512-token system prompt, output
  lognormal(median 150, p90 450).
- rag: long-context retrieval: documents drawn from a pool (several questions each, so prefixes
  repeat), document lognormal(median 8,000, p90 24,000) clipped to the server context; up to
  32,000 tokens, so a 50-page report (~30k tokens) fits where the context allows
  (`--set rag.doc_tokens=30000` makes every document one).
- vlm: ServeGen mm-image (alibaba/ServeGen, Apache-2.0, Qwen-VL production): of requests with
  images ~90% carry one (we keep 80% one, 2..9 otherwise, for more multi-image load); image
  tokens per image clustered at 1,196/1,222 (Qwen2-VL's 720p/1080p counts), hence 720p/1080p
  resolutions; output p50 97 / p90 265 tokens; the median inter-arrival CV over its 2,094
  client windows is 1.37, hence gamma arrivals with shape 0.5 (CV 1.41).
- mixed: chat / rag / vlm together (60/20/20 of the total rate), each its own arrival process.
- chat users: under `rag`, `vlm` and `mixed` a closed population of chat users
  (`chat.background_users`, `--chat-users`) runs beside the profile's own requests, as chats do
  beside long prompts in production: each user sends its next turn a think time
  (`chat.think_s`, exponential) after its answer ends, so that many streams are in flight
  whenever a long prompt or image arrives, whatever the engine's speed. An open-loop chat
  background at a fixed rate (`chat.background_rate`, Poisson, `--chat-background`) can be
  added under `rag` and `vlm`; `--chat-users 0 --chat-background 0` sends no chat beside them.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CLASSES = ("chat", "rag", "vlm")
MAX_CHAT_USERS = 1024  # closed-loop chat users of one run


@dataclass
class ChatProfile:
    """Chat turns behind one shared system prompt (Azure conv trace, see module doc)."""

    rate: float = 4.0  # req/s when --rate is not given
    # req/s of open-loop chat sent under the rag and vlm profiles; --chat-background
    # overrides it, 0 sends none
    background_rate: float = 2.0
    # closed-loop chat users under rag, vlm and mixed (the streams a long prompt or an image
    # stalls): each sends its next turn think_s (exponential mean) after its answer ends;
    # --chat-users overrides it, 0 sends none
    background_users: int = 0
    think_s: float = 1.0
    arrival: str = "poisson"
    burstiness: float = 1.0  # gamma shape (used when arrival is gamma)
    system_prompt_tokens: int = 512
    input_median: float = 800.0
    input_p90: float = 3000.0
    input_min: int = 8
    input_max: int = 8192
    output_median: float = 150.0
    output_p90: float = 450.0
    output_min: int = 1
    output_max: int = 4096


@dataclass
class RagProfile:
    """A pooled document plus a short question (several questions per document)."""

    rate: float = 0.5
    arrival: str = "poisson"
    burstiness: float = 1.0
    num_documents: int = 64
    doc_median: float = 8000.0
    doc_p90: float = 24000.0
    doc_min: int = 256
    doc_max: int = 32000  # covers a 50-page report (~30k tokens)
    doc_tokens: int = 0  # > 0: every document exactly this long (30000 = a 50-page report)
    doc_zipf: float = 0.0  # 0 = documents drawn uniformly; s > 0 = Zipf(s) popularity
    question_median: float = 40.0
    question_p90: float = 100.0
    question_min: int = 4
    question_max: int = 512
    output_median: float = 120.0
    output_p90: float = 300.0
    output_min: int = 1
    output_max: int = 4096


@dataclass
class VlmProfile:
    """Images plus a short instruction (ServeGen mm-image statistics, see module doc)."""

    rate: float = 2.0
    arrival: str = "gamma"
    burstiness: float = 0.5  # gamma shape 0.5: inter-arrival CV = 1/sqrt(0.5) ~ 1.41
    single_image_fraction: float = 0.8
    max_images: int = 9  # the other requests carry 2..max_images images, uniform
    resolutions: tuple[str, ...] = ("1280x720", "640x480", "1920x1080")
    resolution_weights: tuple[float, ...] = (0.4, 0.2, 0.4)
    png_fraction: float = 0.5  # the rest are JPEG
    image_variants: int = 8  # distinct images per (resolution, format); generated once, cached
    instruction_median: float = 30.0
    instruction_p90: float = 80.0
    instruction_min: int = 2
    instruction_max: int = 512
    output_median: float = 100.0
    output_p90: float = 265.0
    output_min: int = 1
    output_max: int = 4096
    camera_streams: int = 0  # > 0: camera mode, N streams each sending one frame per period
    camera_fps: float = 1.0
    camera_jitter_ms: float = 20.0
    camera_resolution: str = "1280x720"


@dataclass
class MixedProfile:
    """Shares of the total rate per class; each class keeps its own arrival process."""

    rate: float = 4.0  # total req/s when --rate is not given
    chat_share: float = 0.6
    rag_share: float = 0.2
    vlm_share: float = 0.2


@dataclass
class Profiles:
    chat: ChatProfile = field(default_factory=ChatProfile)
    rag: RagProfile = field(default_factory=RagProfile)
    vlm: VlmProfile = field(default_factory=VlmProfile)
    mixed: MixedProfile = field(default_factory=MixedProfile)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_resolution(text: str) -> tuple[int, int]:
    """'1280x720' -> (1280, 720)."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise ValueError(f"resolution must look like 1280x720, got {text!r}") from exc
    if w <= 0 or h <= 0 or w > 16384 or h > 16384:
        raise ValueError(f"resolution out of range: {text!r}")
    return w, h


def _convert(raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is tuple:
        (inner, *_rest) = typing.get_args(hint)
        return tuple(_convert(v.strip(), inner) for v in raw.split(",") if v.strip())
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _convert(raw, args[0])
    if hint is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if hint in (int, float, str):
        return hint(raw)
    raise ValueError(f"unsupported field type {hint!r}")


def apply_override(profiles: Profiles, assignment: str) -> None:
    """Apply one `class.field=value` override (tuples comma-separated); ValueError if bad."""
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise ValueError(f"--set wants CLASS.FIELD=VALUE, got {assignment!r}")
    path, raw = assignment.split("=", 1)
    cls_name, field_name = path.strip().split(".", 1)
    target = getattr(profiles, cls_name, None)
    if target is None or not dataclasses.is_dataclass(target):
        raise ValueError(f"unknown profile {cls_name!r} (one of chat, rag, vlm, mixed)")
    hints = typing.get_type_hints(type(target))
    if field_name not in hints:
        names = ", ".join(f.name for f in dataclasses.fields(target))
        raise ValueError(f"unknown field {cls_name}.{field_name}; fields: {names}")
    try:
        value = _convert(raw.strip(), hints[field_name])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad value for {path}: {raw!r} ({exc})") from exc
    setattr(target, field_name, value)


def validate(p: Profiles) -> None:
    """Raise ValueError on impossible parameters (checked once all overrides are applied)."""
    for name in ("chat", "rag", "vlm"):
        prof = getattr(p, name)
        if not prof.rate > 0:
            raise ValueError(f"{name}.rate must be > 0")
        if prof.arrival not in ("poisson", "gamma", "constant"):
            raise ValueError(f"{name}.arrival must be poisson, gamma or constant")
        if not prof.burstiness > 0:
            raise ValueError(f"{name}.burstiness must be > 0")
        if not (1 <= prof.output_min <= prof.output_max):
            raise ValueError(f"{name}: need 1 <= output_min <= output_max")
        if not (0 < prof.output_median <= prof.output_p90):
            raise ValueError(f"{name}: need 0 < output_median <= output_p90")
    c, r, v = p.chat, p.rag, p.vlm
    if c.background_rate < 0:
        raise ValueError("chat.background_rate must be >= 0 (0 = no chat background)")
    if not 0 <= c.background_users <= MAX_CHAT_USERS:
        raise ValueError(f"chat.background_users must be in 0..{MAX_CHAT_USERS} (0 = none)")
    if not c.think_s >= 0 or c.think_s > 3600:
        raise ValueError("chat.think_s must be in [0, 3600] seconds")
    if c.system_prompt_tokens < 0 or not (1 <= c.input_min <= c.input_max):
        raise ValueError("chat: need system_prompt_tokens >= 0 and 1 <= input_min <= input_max")
    if not (0 < c.input_median <= c.input_p90):
        raise ValueError("chat: need 0 < input_median <= input_p90")
    if r.num_documents < 1 or not (1 <= r.doc_min <= r.doc_max) or r.doc_tokens < 0:
        raise ValueError("rag: need num_documents >= 1, 1 <= doc_min <= doc_max, doc_tokens >= 0")
    if not (0 < r.doc_median <= r.doc_p90) or not (0 < r.question_median <= r.question_p90):
        raise ValueError("rag: need 0 < median <= p90 for doc and question")
    if not (1 <= r.question_min <= r.question_max) or r.doc_zipf < 0:
        raise ValueError("rag: need 1 <= question_min <= question_max and doc_zipf >= 0")
    if not (0.0 <= v.single_image_fraction <= 1.0) or v.max_images < 1:
        raise ValueError("vlm: need 0 <= single_image_fraction <= 1 and max_images >= 1")
    if not v.resolutions or len(v.resolutions) != len(v.resolution_weights):
        raise ValueError("vlm: resolutions and resolution_weights must be non-empty, same length")
    if sum(v.resolution_weights) <= 0 or min(v.resolution_weights) < 0:
        raise ValueError("vlm: resolution_weights must be >= 0 with a positive sum")
    for res in (*v.resolutions, v.camera_resolution):
        parse_resolution(res)
    if not (0.0 <= v.png_fraction <= 1.0) or v.image_variants < 1:
        raise ValueError("vlm: need 0 <= png_fraction <= 1 and image_variants >= 1")
    if not (1 <= v.instruction_min <= v.instruction_max):
        raise ValueError("vlm: need 1 <= instruction_min <= instruction_max")
    if v.camera_streams < 0 or not v.camera_fps > 0 or v.camera_jitter_ms < 0:
        raise ValueError("vlm: need camera_streams >= 0, camera_fps > 0, camera_jitter_ms >= 0")
    m = p.mixed
    if not m.rate > 0:
        raise ValueError("mixed.rate must be > 0")
    shares = (m.chat_share, m.rag_share, m.vlm_share)
    if min(shares) < 0 or sum(shares) <= 0:
        raise ValueError("mixed: shares must be >= 0 with a positive sum")
