"""Image decoding, Qwen2-VL resizing and the vision encoder's shapes."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from engine.server.multimodal import (
    ImageError,
    decode_data_url,
    encode_data_url,
    load_image_pixels,
    num_image_tokens,
    smart_resize,
)


def _image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    ("h", "w", "cap", "expected"),
    [
        (224, 224, 1280, (224, 224)),  # already multiples of 28
        (10, 10, 1280, (56, 56)),  # scaled up to the 4-token minimum
        (1080, 1920, 1280, (728, 1316)),  # scaled down under the cap
        (100, 150, 4, (56, 56)),
    ],
)
def test_smart_resize_examples(h: int, w: int, cap: int, expected: tuple[int, int]) -> None:
    assert smart_resize(h, w, token_cap=cap) == expected


def test_smart_resize_invariants() -> None:
    for h in range(1, 700, 37):
        for w in range(1, 700, 41):
            if max(h, w) / min(h, w) > 200:
                continue
            for cap in (4, 9, 64, 1280):
                th, tw = smart_resize(h, w, token_cap=cap)
                assert th % 28 == 0 and tw % 28 == 0
                assert 4 <= (th // 28) * (tw // 28) <= cap


def test_extreme_aspect_ratio_refused() -> None:
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(10, 5000)


def test_png_and_jpeg_round_trip() -> None:
    px = _image(100, 150)
    png_pixels, png_hash = load_image_pixels(encode_data_url(px, "PNG"))
    assert png_pixels.shape == (112, 140, 3) and png_pixels.dtype == np.uint8
    again, again_hash = load_image_pixels(encode_data_url(px, "PNG"))
    assert again_hash == png_hash and np.array_equal(again, png_pixels)
    jpg_pixels, jpg_hash = load_image_pixels(encode_data_url(px, "JPEG"), token_cap=16)
    assert (jpg_pixels.shape[0] // 28) * (jpg_pixels.shape[1] // 28) <= 16
    assert jpg_hash != png_hash
    assert num_image_tokens(100, 150) == (112 // 28) * (140 // 28)


def test_rgba_png_is_flattened() -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGBA", (30, 30), (255, 0, 0, 0)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    pixels, _ = load_image_pixels(url)
    assert pixels.shape[2] == 3


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("https://example.com/cat.png", "remote image URLs"),
        ("file:///etc/passwd", "data URL"),
        ("data:image/gif;base64,R0lGOD", "not supported"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,@@@@", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "decoded"),
    ],
)
def test_bad_urls(url: str, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        load_image_pixels(url)


def test_size_limits() -> None:
    url = encode_data_url(_image(64, 64))
    with pytest.raises(ImageError, match="limit"):
        decode_data_url(url, max_bytes=100)
    with pytest.raises(ImageError, match="pixel limit"):
        load_image_pixels(url, max_pixels=1000)


def test_vision_encoder_shapes_and_determinism() -> None:
    import torch

    from engine.model.vision import VisionEncoder

    enc, twin, other = VisionEncoder(64), VisionEncoder(64), VisionEncoder(64, seed=1)
    pixels = torch.from_numpy(_image(56, 84))
    with torch.no_grad():
        out = enc(pixels)
        assert out.shape == (2 * 3, 64) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        assert torch.equal(out, twin(pixels))
        assert not torch.equal(out, other(pixels))
        half = VisionEncoder(64).to(torch.bfloat16)(pixels)
        assert half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiples of 28"):
        enc(torch.zeros(30, 28, 3, dtype=torch.uint8))


def test_vision_encoder_bands_equal_the_whole_image() -> None:
    """Attention is local to a band of merged-token rows: any run of bands encodes to exactly
    the rows of the whole image's output (bit for bit), so chunks can encode what they need."""
    import torch

    from engine.model.vision import VisionEncoder

    enc = VisionEncoder(64, band_rows=2)
    pixels = torch.from_numpy(_image(28 * 5, 28 * 3))  # 5 x 3 tokens: bands of 6, 6 and 3
    assert enc.num_bands(28 * 5) == 3 and enc.band_tokens(28 * 3) == 6
    with torch.no_grad():
        whole = enc(pixels)
        assert whole.shape == (15, 64)
        assert torch.equal(enc.encode_bands(pixels, 0, 1), whole[:6])
        assert torch.equal(enc.encode_bands(pixels, 1, 3), whole[6:])
        assert torch.equal(enc.encode_bands(pixels, 2, 3), whole[12:])
        # the bands are independent: other pixels in band 0 leave band 1 unchanged
        changed = pixels.clone()
        changed[:56] = 255 - changed[:56]
        other = enc(changed)
        assert not torch.equal(other[:6], whole[:6]) and torch.equal(other[6:], whole[6:])
    for first, last in ((0, 0), (-1, 1), (2, 4)):
        with pytest.raises(ValueError, match="outside the image"):
            enc.encode_bands(pixels, first, last)
    with pytest.raises(ValueError, match="band_rows"):
        VisionEncoder(64, band_rows=0)


def test_chat_prompt_template() -> None:
    from engine.server.chat import ChatTurn, build_chat_prompt

    class ByteTok:
        bos_token_id = 256
        image_token_id = 258

        def encode(self, text: str) -> list[int]:
            return list(text.encode())

    class Img:
        num_tokens = 3

    ids = build_chat_prompt(
        [ChatTurn("system", ["hi"]), ChatTurn("user", ["look ", Img()])], ByteTok()
    )
    text = bytes(i for i in ids if i < 256).decode()
    assert ids[0] == 256
    assert text == "<|system|>\nhi\n<|user|>\nlook \n<|assistant|>\n"
    assert ids.count(258) == 3
