"""Seeded generators hit their targets: medians and p90s within tolerance, shared prefixes."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.distributions import LogNormal
from loadgen.profiles import Profiles, apply_override, validate
from loadgen.spec import fit_context
from loadgen.tokens import Segment, TokenSource
from loadgen.workload import PlanOptions, build_plan


def _plan(profile: str, n: int = 4000, ctx: int = 32768, seed: int = 3, **over: str):
    p = Profiles()
    for k, v in over.items():
        apply_override(p, f"{k.replace('__', '.')}={v}")
    validate(p)
    return build_plan(p, PlanOptions(profile=profile, num_requests=n, seed=seed, max_model_len=ctx))


def test_lognormal_quantiles() -> None:
    d = LogNormal(800, 3000, 8, 8192)
    x = d.sample(np.random.default_rng(0), 50_000)
    assert np.median(x) == pytest.approx(800, rel=0.04)
    assert np.percentile(x, 90) == pytest.approx(3000, rel=0.06)
    assert x.min() >= 8 and x.max() <= 8192
    with pytest.raises(ValueError):
        LogNormal(100, 50)


def test_chat_profile_targets() -> None:
    specs = _plan("chat")
    user = np.array([s.segments[1].length for s in specs])
    out = np.array([s.max_tokens for s in specs])
    assert np.median(user) == pytest.approx(800, rel=0.08)
    assert np.percentile(user, 90) == pytest.approx(3000, rel=0.1)
    assert user.min() >= 8 and user.max() <= 8192
    assert np.median(out) == pytest.approx(150, rel=0.08)
    assert np.percentile(out, 90) == pytest.approx(450, rel=0.1)
    assert {s.segments[0] for s in specs} == {Segment("chat/system", 512, shared=True)}


def test_chat_is_seeded() -> None:
    a, b, c = _plan("chat", 50, seed=1), _plan("chat", 50, seed=1), _plan("chat", 50, seed=2)
    assert [s.max_tokens for s in a] == [s.max_tokens for s in b]
    assert [s.max_tokens for s in a] != [s.max_tokens for s in c]


def test_rag_profile_targets_and_prefix_reuse() -> None:
    specs = _plan("rag", 3000, rag__num_documents=2000)
    doc = np.array([s.segments[0].length for s in specs])
    assert np.median(doc) == pytest.approx(8000, rel=0.1)
    assert np.percentile(doc, 90) == pytest.approx(24000, rel=0.12)
    assert np.median([s.max_tokens for s in specs]) == pytest.approx(120, rel=0.1)
    small = _plan("rag", 400)  # 64 documents: questions share documents
    docs = [s.meta["doc"] for s in small]
    assert len(set(docs)) <= 64 and len(docs) > 3 * len(set(docs))


def test_rag_clips_to_context_and_fits_a_report() -> None:
    for s in _plan("rag", 300, ctx=4096):
        assert s.prompt_len + s.max_tokens <= 4096
    report = _plan("rag", 20, ctx=32768, rag__doc_tokens="30000")
    assert all(s.segments[0].length >= 29_000 for s in report)


def test_vlm_image_counts_and_resolutions() -> None:
    specs = _plan("vlm", 3000)
    counts = np.array([len(s.images) for s in specs])
    assert np.mean(counts == 1) == pytest.approx(0.8, abs=0.03)
    assert counts.max() <= 9 and counts.min() >= 1
    assert set(counts[counts > 1]) <= set(range(2, 10))
    sizes = {(i.width, i.height) for s in specs for i in s.images}
    assert sizes == {(1280, 720), (640, 480), (1920, 1080)}
    assert {i.fmt for s in specs for i in s.images} == {"png", "jpeg"}
    assert np.median([s.max_tokens for s in specs]) == pytest.approx(100, rel=0.1)
    assert all(s.text for s in specs)


def test_mixed_shares() -> None:
    specs = _plan("mixed", 5000)
    classes = [s.traffic_class for s in specs]
    for cls, share in (("chat", 0.6), ("rag", 0.2), ("vlm", 0.2)):
        assert classes.count(cls) / len(classes) == pytest.approx(share, abs=0.04)
    offs = [s.offset_s for s in specs]
    assert offs == sorted(offs) and [s.index for s in specs] == list(range(len(specs)))


def test_shared_segments_are_identical_prefixes() -> None:
    src = TokenSource(seed=7, lo=32, hi=126)
    a = src.tokens([Segment("doc", 1000, shared=True), Segment("q1", 30)])
    b = src.tokens([Segment("doc", 700, shared=True), Segment("q2", 30)])
    assert a[:700] == b[:700] and a[1000:] != b[700:]
    assert min(a) >= 32 and max(a) <= 126 and len(a) == 1030
    assert TokenSource(seed=7).tokens([Segment("doc", 50)]) == a[:50]  # cache-independent
    assert TokenSource(seed=8).tokens([Segment("doc", 50)]) != a[:50]
    assert len(src.text([Segment("doc", 20)]).split()) == 20


def test_fit_context() -> None:
    assert fit_context(100, 50, 1000) == (100, 50)
    assert fit_context(5000, 200, 1000) == (800, 200)
    p, o = fit_context(10, 5000, 1000, min_prompt=10)
    assert p == 10 and o == 990


def test_bad_override() -> None:
    p = Profiles()
    for bad in ("chat.nope=1", "nochat.rate=1", "chat.rate=abc", "chat.rate"):
        with pytest.raises(ValueError):
            apply_override(p, bad)
    apply_override(p, "chat.input_p90=10")
    with pytest.raises(ValueError):
        validate(p)


def test_camera_mode() -> None:
    specs = _plan(
        "vlm", 60, vlm__camera_streams="3", vlm__camera_fps="5", vlm__camera_resolution="320x240"
    )
    assert len(specs) == 60
    assert {(i.width, i.height, i.fmt) for s in specs for i in s.images} == {(320, 240, "jpeg")}
    assert {s.meta["stream"] for s in specs} == {0, 1, 2}
    frames = [s.meta["frame"] for s in specs if s.meta["stream"] == 0]
    assert frames == list(range(len(frames)))
