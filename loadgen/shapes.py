"""Named shape sets: ``--set`` overrides sized for one kind of server, picked with ``--shapes``.

``realistic`` is the profiles' own defaults (production statistics, see ``profiles.py``): right
for a GPU server, far beyond the CPU ``demo`` engine (``mixed`` at its default rate gives TTFTs
of tens of seconds there). ``demo`` is sized for chunkscope's ``demo`` preset on two CPU cores:
chat streams stay below saturation at any budget while each RAG prompt (2,500-4,000 tokens) or
image (1280x720, 1,196 tokens) is a step of hundreds of milliseconds to seconds at a large budget,
which every chat stream in flight waits for. ``auto`` (the CLI's default) picks ``demo`` when
the server's model is the ``demo`` or ``tiny`` preset and ``realistic`` otherwise.
"""

from __future__ import annotations

import logging

from loadgen.profiles import Profiles, apply_override, validate

logger = logging.getLogger(__name__)

CHAT_DEMO = (
    "chat.rate=1.0",
    # the streams a long prompt stalls: a closed population, so several are in flight whenever
    # a RAG prompt or an image arrives (an open-loop 1 req/s had about half a stream in flight:
    # the demo engine streams a 150-token answer in about half a second)
    "chat.background_rate=0",
    "chat.background_users=4",
    "chat.think_s=0.3",
    "chat.system_prompt_tokens=32",
    "chat.input_median=48",
    "chat.input_p90=160",
    "chat.input_max=512",
    "chat.output_median=150",
    "chat.output_p90=300",
    "chat.output_max=400",
)
RAG_DEMO = (
    "rag.rate=0.12",
    "rag.num_documents=256",  # few repeats in a few minutes: the prefix cache rarely hides one
    # 2,500-4,000 tokens: at budget 4096 one step of about 12-20x a 256-token chunk's, so the
    # stall it causes stands clear of one chunk's even when the machine slows a chunk 3-4x
    "rag.doc_median=3200",
    "rag.doc_p90=3800",
    "rag.doc_min=2500",
    "rag.doc_max=4000",  # fits a 4096 budget: one prompt, one long step
    "rag.output_median=32",
    "rag.output_p90=64",
    "rag.output_max=128",
)
VLM_DEMO = (
    "vlm.rate=0.15",
    # 720p (1,196 image tokens): one step of over a second at budget 4096 among chat streams.
    # 640x480 (391 tokens) made 0.5 s steps, only ~3x a 256-token step: too close to tell apart
    "vlm.resolutions=1280x720",
    "vlm.resolution_weights=1",
    "vlm.single_image_fraction=1.0",
    "vlm.output_median=64",
    "vlm.output_p90=128",
    "vlm.output_max=256",
)
MIXED_DEMO = (
    "mixed.rate=1.2",
    "mixed.chat_share=0.85",
    "mixed.rag_share=0.1",
    "mixed.vlm_share=0.05",  # an image every ~17 s: at 12 % (1.3 req/s) bursts saturated it
)
SHAPES: dict[str, tuple[str, ...]] = {
    "realistic": (),
    "demo": (*CHAT_DEMO, *RAG_DEMO, *VLM_DEMO, *MIXED_DEMO),
}
CHOICES = ("auto", *SHAPES)
DEMO_MODELS = ("demo", "tiny")


def resolve(name: str, model: str | None) -> str:
    """The shape set ``name`` stands for against a server serving ``model``."""
    if name == "auto":
        return "demo" if (model or "").lower() in DEMO_MODELS else "realistic"
    if name not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


def shaped_profiles(shapes: str, overrides: list[str] | tuple[str, ...] = ()) -> Profiles:
    """The profiles after the named shape set, then ``overrides`` (the user's ``--set``),
    validated; ValueError on a bad name or override."""
    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {', '.join(SHAPES)}, got {shapes!r}")
    profiles = Profiles()
    for item in (*SHAPES[shapes], *overrides):
        apply_override(profiles, item)
    validate(profiles)
    return profiles


def background_users(
    profile: str, requested: int | None, profiles: Profiles, *, trace: bool
) -> int:
    """Closed-loop chat users beside the profile's requests: ``requested`` when given, else
    ``chat.background_users`` under ``rag``, ``vlm`` and ``mixed``, else 0."""
    if requested is not None:
        return requested
    if trace or profile not in ("rag", "vlm", "mixed"):
        return 0
    return profiles.chat.background_users


def background_rate(
    profile: str, requested: float | None, profiles: Profiles, *, trace: bool
) -> float:
    """Req/s of the chat background: ``requested`` when given, else ``chat.background_rate``
    under ``rag`` and ``vlm`` (profiles with no chat of their own), else 0."""
    if requested is not None:
        return requested
    if trace or profile not in ("rag", "vlm"):
        return 0.0
    return profiles.chat.background_rate
