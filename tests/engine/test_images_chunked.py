"""Image tokens are prompt tokens: chunked like text; the result does not depend on the budget.

The vision encoder is part of every build: if it fails to import these tests fail (the engine
would quietly refuse images), they never skip."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from engine.core.request import ImageInput
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.vision import VisionEncoder  # an import error fails the module, not a skip


def _image(h: int, w: int, seed: int) -> ImageInput:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    pixels = np.stack([(xx * 255 // w), (yy * 255 // h), rng.integers(0, 255, (h, w))], -1)
    pixels = pixels.astype(np.uint8)
    return ImageInput(pixels, hashlib.sha256(pixels.tobytes()).hexdigest())


def _assert_vision(engine: LLMEngine) -> None:
    assert engine.tokenizer.image_token_id is not None, "the tiny preset has an image token"
    assert isinstance(engine.vision, VisionEncoder), "the engine built no vision encoder"
    assert engine.limits.accepts_images


def test_image_request_same_output_at_every_budget(make_engine) -> None:
    engine = make_engine(token_budget=512, max_token_budget=512, enable_prefix_caching=False)
    _assert_vision(engine)
    img_a, img_b = _image(56, 84, 1), _image(112, 56, 2)  # 6 and 8 image tokens
    tok = engine.tokenizer
    prompt = (
        tok.encode("<|user|>\n", add_bos=True)
        + [tok.image_token_id] * img_a.num_tokens
        + tok.encode(" and ")
        + [tok.image_token_id] * img_b.num_tokens
        + tok.encode(" describe both\n<|assistant|>\n")
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = []
    for budget in (512, 5, 1):
        engine.set_token_budget(budget)
        engine.runner.keep_logits = True
        engine.runner.kept_logits.clear()
        rid = engine.add_request(prompt, params, images=[img_a, img_b])
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                assert out.num_image_tokens == 14
                tokens.extend(out.new_token_ids)
        results.append((tokens, engine.runner.kept_logits[rid][0]))
    for tokens, logits in results[1:]:
        assert tokens == results[0][0]
        assert np.allclose(logits.numpy(), results[0][1].numpy(), atol=1e-4)
    # the images change the output: same prompt with other pixels gives other logits
    engine.runner.kept_logits.clear()
    other = engine.add_request(prompt, params, images=[_image(56, 84, 9), img_b])
    while engine.has_unfinished_requests():
        engine.step()
    assert not np.allclose(engine.runner.kept_logits[other][0].numpy(), results[0][1].numpy())


def test_image_token_count_mismatch_is_refused(make_engine) -> None:
    engine = make_engine()
    _assert_vision(engine)
    img = _image(56, 56, 0)  # 4 tokens
    prompt = [1, 2] + [engine.tokenizer.image_token_id] * 3
    with pytest.raises(ValueError, match="image"):
        engine.add_request(prompt, SamplingParams(), images=[img])
    with pytest.raises(ValueError, match="image"):
        engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished_requests()


def test_back_to_back_images_share_one_placeholder_run(make_engine) -> None:
    engine = make_engine()
    _assert_vision(engine)
    imgs = [_image(56, 84, 1), _image(56, 56, 2), _image(56, 56, 3)]  # 6, 4, 4 tokens
    image_id = engine.tokenizer.image_token_id
    prompt = [1, 2] + [image_id] * 14 + [3]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), images=imgs)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step().outputs)
    assert outputs[-1].request_id == rid and outputs[-1].num_image_tokens == 14
    with pytest.raises(ValueError, match="consecutive"):
        engine.add_request([image_id] * 3 + [5] + [image_id] * 5, SamplingParams(), images=imgs[1:])


def test_encoder_work_follows_the_chunks(make_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vision encoder runs band by band with the prefill chunks: a step encodes only the
    bands its chunk's image tokens lie in, every band exactly once, so a small budget bounds an
    image's encoder work per step as it bounds its prefill (a whole-image encode in the first
    chunk's step would stall every stream at any budget)."""
    engine = make_engine(token_budget=512, max_token_budget=512, enable_prefix_caching=False)
    _assert_vision(engine)
    vision = engine.vision
    img = _image(28 * 6, 28 * 4, 3)  # a 6 x 4 grid of image tokens: 6 bands of 4
    assert vision.num_bands(28 * 6) == 6 and vision.band_tokens(28 * 4) == 4
    image_id = engine.tokenizer.image_token_id
    prompt = [1, 2, 3] + [image_id] * 24 + [4, 5]
    calls: list[tuple[int, int]] = []
    encode = vision.encode_bands

    def spy(pixels, first: int, last: int):  # type: ignore[no-untyped-def]
        calls.append((first, last))
        return encode(pixels, first, last)

    monkeypatch.setattr(vision, "encode_bands", spy)
    per_step: dict[int, list[list[int]]] = {}
    for budget in (512, 6):
        engine.set_token_budget(budget)
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), images=[img])
        steps = []
        while engine.has_unfinished_requests():
            before = len(calls)
            engine.step()
            steps.append([k for first, last in calls[before:] for k in range(first, last)])
        per_step[budget] = [s for s in steps if s]
    assert per_step[512] == [list(range(6))]  # one step, the whole image
    chunked = per_step[6]
    assert sorted(k for s in chunked for k in s) == list(range(6))  # each band once
    # a chunk of 6 tokens touches at most 3 bands of 4 tokens; most steps encode 1 or 2
    assert len(chunked) >= 4 and max(len(s) for s in chunked) <= 3


def test_image_tokens_cost_the_encoder_share_of_the_budget(make_engine) -> None:
    """By default an image token costs 1 + the encoder's work per token over the language
    model's (from their sizes); ``image_token_cost`` sets it."""
    engine = make_engine()
    assert 1.0 < engine.scheduler.image_token_cost < 8.0
    assert make_engine(image_token_cost=2.5).scheduler.image_token_cost == 2.5
    with pytest.raises(ValueError, match="image_token_cost"):
        make_engine(image_token_cost=0.5)
