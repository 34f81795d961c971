"""Build the request plan for a profile: arrival times from the class's process, lengths from its
distributions, prompts as shared/unique token segments. Everything is seeded.

Arrivals and lengths use separate random streams per class, so changing the rate keeps lengths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from loadgen.arrivals import ArrivalSpec, arrival_times, camera_times
from loadgen.distributions import LogNormal
from loadgen.profiles import (
    CLASSES,
    ChatProfile,
    Profiles,
    RagProfile,
    VlmProfile,
    parse_resolution,
)
from loadgen.spec import ImageRef, RequestSpec, fit_context, reindex
from loadgen.tokens import Segment, words

logger = logging.getLogger(__name__)

PROFILES = ("chat", "rag", "vlm", "mixed")


@dataclass(frozen=True)
class PlanOptions:
    """Run-level knobs shared by every class (CLI flags)."""

    profile: str = "chat"
    rate: float | None = None  # total req/s; None = the profile's default
    arrival: str | None = None  # None = each class's own default
    burstiness: float | None = None
    ramp_s: float = 0.0
    ramp_from: float = 0.0  # req/s at t=0 of the ramp (total, split by share in a mix)
    duration: float | None = None
    num_requests: int | None = None
    seed: int = 0
    max_model_len: int = 8192
    background_chat: float = 0.0  # req/s of chat beside the profile's own requests (0 = none)


def _rngs(seed: int, cls: str) -> tuple[np.random.Generator, np.random.Generator]:
    cid = CLASSES.index(cls) + 1
    return np.random.default_rng([seed, cid, 0]), np.random.default_rng([seed, cid, 1])


def _times(
    prof: ChatProfile | RagProfile | VlmProfile,
    share: float,
    o: PlanOptions,
    rng: np.random.Generator,
) -> np.ndarray:
    spec = ArrivalSpec(
        kind=o.arrival or prof.arrival,
        rate=(o.rate if o.rate is not None else prof.rate) * share,
        burstiness=o.burstiness if o.burstiness is not None else prof.burstiness,
        ramp_s=o.ramp_s,
        ramp_from=o.ramp_from * share,
    )
    return arrival_times(spec, rng, num=o.num_requests, duration=o.duration)


def chat_specs(
    p: ChatProfile,
    times: np.ndarray,
    rng: np.random.Generator,
    ctx: int,
    *,
    name: str = "chat",
) -> list[RequestSpec]:
    sys_len = min(p.system_prompt_tokens, max(0, ctx // 2))
    inp = LogNormal(p.input_median, p.input_p90, p.input_min, p.input_max)
    out = LogNormal(p.output_median, p.output_p90, p.output_min, p.output_max)
    sys_seg = Segment("chat/system", sys_len, shared=True)
    specs = []
    for i, t in enumerate(times):
        u, o = int(inp.sample(rng)), int(out.sample(rng))
        budget, o = fit_context(sys_len + u, o, ctx, min_prompt=sys_len + 1)
        u = max(1, budget - sys_len)
        own = Segment(f"{name}/u{i}", u)  # never shared: its own name per population
        segs = (sys_seg, own) if sys_len else (own,)
        meta = {"background": True} if name != "chat" else {}
        specs.append(RequestSpec(i, "chat", float(t), o, segs, meta=meta))
    return specs


def rag_specs(
    p: RagProfile, times: np.ndarray, rng: np.random.Generator, ctx: int
) -> list[RequestSpec]:
    n = p.num_documents
    doc_lens: np.ndarray
    if p.doc_tokens > 0:
        doc_lens = np.full(n, p.doc_tokens, dtype=np.int64)
    else:
        doc_lens = np.asarray(
            LogNormal(p.doc_median, p.doc_p90, p.doc_min, p.doc_max).sample(rng, n)
        )
    weights = 1.0 / np.arange(1, n + 1) ** p.doc_zipf
    weights /= weights.sum()
    q_dist = LogNormal(p.question_median, p.question_p90, p.question_min, p.question_max)
    out = LogNormal(p.output_median, p.output_p90, p.output_min, p.output_max)
    specs = []
    for i, t in enumerate(times):
        d = int(rng.choice(n, p=weights))
        q, o = int(q_dist.sample(rng)), int(out.sample(rng))
        q = min(q, max(1, ctx // 4))
        budget, o = fit_context(int(doc_lens[d]) + q, o, ctx, min_prompt=q + 1)
        doc_used = max(1, budget - q)  # a prefix of the shared document: caches still hit
        segs = (Segment(f"rag/doc{d}", doc_used, shared=True), Segment(f"rag/q{i}", q))
        specs.append(RequestSpec(i, "rag", float(t), o, segs, meta={"doc": d}))
    return specs


def vlm_specs(
    p: VlmProfile,
    times: np.ndarray,
    rng: np.random.Generator,
    ctx: int,
    streams: np.ndarray | None = None,
) -> list[RequestSpec]:
    res = [parse_resolution(r) for r in p.resolutions]
    w = np.asarray(p.resolution_weights, dtype=float)
    w /= w.sum()
    cam = parse_resolution(p.camera_resolution)
    instr = LogNormal(p.instruction_median, p.instruction_p90, p.instruction_min, p.instruction_max)
    out = LogNormal(p.output_median, p.output_p90, p.output_min, p.output_max)
    frames: dict[int, int] = {}
    specs = []
    for i, t in enumerate(times):
        meta: dict[str, int] = {}
        if streams is not None:
            sid = int(streams[i])
            k = frames[sid] = frames.get(sid, -1) + 1
            images: tuple[ImageRef, ...] = (
                ImageRef(*cam, "jpeg", (sid * 7 + k) % p.image_variants),
            )
            meta = {"stream": sid, "frame": k}
        else:
            single = p.max_images <= 1 or rng.random() < p.single_image_fraction
            count = 1 if single else int(rng.integers(2, p.max_images + 1))
            images = tuple(
                ImageRef(
                    *res[int(rng.choice(len(res), p=w))],
                    "png" if rng.random() < p.png_fraction else "jpeg",
                    int(rng.integers(0, p.image_variants)),
                )
                for _ in range(count)
            )
        n_words, o = int(instr.sample(rng)), int(out.sample(rng))
        o = fit_context(n_words, o, ctx)[1]
        text = words(rng, n_words)
        specs.append(RequestSpec(i, "vlm", float(t), o, images=images, text=text, meta=meta))
    return specs


BACKGROUND_STREAM = 9  # the chat background's random streams, apart from every class's own


def background_chat_specs(p: ChatProfile, o: PlanOptions) -> list[RequestSpec]:
    """The chat population beside the profile's requests: chat shapes, the chat arrival process
    at ``o.background_chat`` req/s, steady (no ramp), its own random streams and prompts."""
    arr_rng = np.random.default_rng([o.seed, BACKGROUND_STREAM, 0])
    len_rng = np.random.default_rng([o.seed, BACKGROUND_STREAM, 1])
    spec = ArrivalSpec(
        kind=o.arrival or p.arrival,
        rate=o.background_chat,
        burstiness=o.burstiness if o.burstiness is not None else p.burstiness,
    )
    times = arrival_times(spec, arr_rng, num=o.num_requests, duration=o.duration)
    return chat_specs(p, times, len_rng, o.max_model_len, name="chat-bg")


USERS_STREAM = 10  # the closed-loop chat users' random streams (one per user under it)
MAX_TURNS = 1_000_000  # per user: bounds a run that nothing else stops


@dataclass(frozen=True)
class ChatUsers:
    """A closed population of ``count`` chat users beside the plan: each sends a chat turn, reads
    the answer to its end, thinks (exponential, mean ``think_s``) and sends the next, so about
    ``count`` streams are in flight at any moment, whatever the server's speed. Turns are drawn
    lazily from each user's own seeded stream (same seed, same turns); no user sends after
    ``until_s`` seconds of the plan's time (None: once the plan's own requests are all sent).
    The users start ``lead_s`` before the plan's first request."""

    profile: ChatProfile
    count: int
    seed: int = 0
    max_model_len: int = 8192
    until_s: float | None = None
    # the users start this long before the plan's own requests (which move later by as much):
    # streams are in flight when the first long prompt arrives, however early the plan sends it
    lead_s: float = 1.0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"chat users must be >= 0, got {self.count}")
        if not 0 <= self.lead_s <= 60:
            raise ValueError(f"chat users' lead must be in [0, 60] s, got {self.lead_s}")

    def turns(self, user: int) -> Iterator[tuple[float, RequestSpec]]:
        """User ``user``'s (pause before it, turn) pairs: every user sends its first turn at
        once (so streams are in flight before the profile's first long prompt, which may come
        within milliseconds), then a think time before each next one."""
        rng = np.random.default_rng([self.seed, USERS_STREAM, user])
        think = self.profile.think_s
        pause = 0.0
        for turn in range(MAX_TURNS):
            name = f"chat-u{user}-t{turn}"
            (spec,) = chat_specs(self.profile, np.zeros(1), rng, self.max_model_len, name=name)
            spec.meta["user"] = user
            yield pause, spec
            pause = float(rng.exponential(think)) if think > 0 else 0.0


def build_plan(profiles: Profiles, o: PlanOptions) -> list[RequestSpec]:
    """All requests of the run, sorted by send offset and numbered."""
    if o.profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {o.profile!r}")
    if o.num_requests is None and o.duration is None:
        raise ValueError("need num_requests and/or duration")
    if o.profile == "mixed":
        m = profiles.mixed
        total = m.chat_share + m.rag_share + m.vlm_share
        shares = {
            "chat": m.chat_share / total,
            "rag": m.rag_share / total,
            "vlm": m.vlm_share / total,
        }
        rate = o.rate if o.rate is not None else m.rate
        # class rate = total * share; _times multiplies its `rate` by share
        o = PlanOptions(**{**o.__dict__, "rate": rate})
    else:
        shares = {o.profile: 1.0}
    specs: list[RequestSpec] = []
    for cls, share in shares.items():
        if share <= 0:
            continue
        prof = getattr(profiles, cls)
        arr_rng, len_rng = _rngs(o.seed, cls)
        if cls == "vlm" and prof.camera_streams > 0:
            times, sids = camera_times(
                prof.camera_streams,
                prof.camera_fps,
                prof.camera_jitter_ms / 1000.0,
                arr_rng,
                num=o.num_requests,
                duration=o.duration,
            )
            specs += vlm_specs(prof, times, len_rng, o.max_model_len, sids)
            continue
        times = _times(prof, share, o, arr_rng)
        builders: dict[str, Callable[..., list[RequestSpec]]] = {
            "chat": chat_specs, "rag": rag_specs, "vlm": vlm_specs
        }  # fmt: skip
        builder = builders[cls]
        specs += builder(prof, times, len_rng, o.max_model_len)
    if o.background_chat > 0:
        specs += background_chat_specs(profiles.chat, o)
    specs = reindex(specs)
    if o.num_requests is not None:
        specs = specs[: o.num_requests]
    logger.info("planned %d requests (%s)", len(specs), o.profile)
    return specs
