"""Image inputs: decode base64 data URLs (PNG/JPEG), resize Qwen2-VL style, count image tokens.

One image token stands for 28x28 pixels after resizing (14x14 patches merged 2x2). ``smart_resize``
rounds height and width to multiples of 28 while keeping the aspect ratio, scales down until the
token count fits the cap and up to at least :data:`MIN_IMAGE_TOKENS`. No torch here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import math
import warnings
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.core.request import ImageInput

logger = logging.getLogger(__name__)

IMAGE_FACTOR = 28
MIN_IMAGE_TOKENS = 4
DEFAULT_IMAGE_TOKEN_CAP = 1280
MAX_ASPECT_RATIO = 200
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
SUPPORTED_MIME = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG"}


class ImageError(ValueError):
    """An image the engine cannot take; the message says what to change."""


def _round(x: float, f: int) -> int:
    return round(x / f) * f


def _floor(x: float, f: int) -> int:
    return math.floor(x / f) * f


def _ceil(x: float, f: int) -> int:
    return math.ceil(x / f) * f


def smart_resize(
    height: int,
    width: int,
    *,
    token_cap: int = DEFAULT_IMAGE_TOKEN_CAP,
    min_tokens: int = MIN_IMAGE_TOKENS,
    factor: int = IMAGE_FACTOR,
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, aspect kept, token count bounded.

    The result satisfies ``min_tokens <= (h // factor) * (w // factor) <= token_cap`` (the Qwen2-VL
    rule, with pixels counted in units of ``factor x factor``).
    """
    if height < 1 or width < 1:
        raise ImageError(f"image must have positive size, got {width}x{height}")
    if token_cap < min_tokens:
        raise ValueError(f"token_cap must be at least {min_tokens}, got {token_cap}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"image aspect ratio must be below {MAX_ASPECT_RATIO}, got {width}x{height}; "
            "crop or pad the image"
        )
    max_pixels = token_cap * factor * factor
    min_pixels = min_tokens * factor * factor
    h_bar = max(factor, _round(height, factor))
    w_bar = max(factor, _round(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, _floor(height / beta, factor))
        w_bar = max(factor, _floor(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil(height * beta, factor)
        w_bar = _ceil(width * beta, factor)
    # Flooring can undershoot the minimum when the cap is small: grow the side that keeps the
    # aspect ratio closest, as long as the cap allows.
    aspect = width / height
    while (h_bar // factor) * (w_bar // factor) < min_tokens:
        options = [
            (hh, ww)
            for hh, ww in ((h_bar + factor, w_bar), (h_bar, w_bar + factor))
            if hh * ww <= max_pixels
        ]
        if not options:
            break
        h_bar, w_bar = min(options, key=lambda o: abs(math.log((o[1] / o[0]) / aspect)))
    # Very thin images with a tiny cap can still overshoot after clamping to one factor.
    while h_bar * w_bar > max_pixels:
        if h_bar >= w_bar and h_bar > factor:
            h_bar -= factor
        elif w_bar > factor:
            w_bar -= factor
        else:
            break
    return h_bar, w_bar


def num_image_tokens(height: int, width: int, *, token_cap: int = DEFAULT_IMAGE_TOKEN_CAP) -> int:
    """Image tokens for an original ``height x width`` image after :func:`smart_resize`."""
    h, w = smart_resize(height, width, token_cap=token_cap)
    return (h // IMAGE_FACTOR) * (w // IMAGE_FACTOR)


def decode_data_url(url: str, *, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> tuple[bytes, str]:
    """``data:image/png;base64,...`` → (raw bytes, Pillow format name)."""
    if not isinstance(url, str):
        raise ImageError("image_url.url must be a string")
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "remote image URLs are not fetched by this server; send the image inline as "
            "'data:image/png;base64,...' or 'data:image/jpeg;base64,...'"
        )
    if not url.startswith("data:"):
        raise ImageError(
            "image_url.url must be a data URL like 'data:image/png;base64,...' "
            f"(got one starting with {url[:16]!r})"
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("image data URL has no ',' between its header and the base64 data")
    parts = [p.strip().lower() for p in header.split(";")]
    mime = parts[0]
    if "base64" not in parts[1:]:
        raise ImageError("image data URL must be base64-encoded ('data:image/png;base64,...')")
    if mime not in SUPPORTED_MIME:
        raise ImageError(
            f"image type {mime or '(none)'!r} is not supported; send image/png or image/jpeg"
        )
    # base64 expands 3 bytes into 4 characters: refuse before decoding anything large.
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageError(
            f"image is larger than the {max_bytes // (1024 * 1024)} MiB limit "
            f"({len(payload) * 3 // 4} bytes); downscale or recompress it"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"image data URL is not valid base64: {exc}") from exc
    if len(data) > max_bytes:
        raise ImageError(f"image is larger than the {max_bytes} byte limit ({len(data)} bytes)")
    if not data:
        raise ImageError("image data URL holds no data")
    return data, SUPPORTED_MIME[mime]


def decode_image(
    data: bytes,
    *,
    expected_format: str | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> np.ndarray:
    """PNG/JPEG bytes → uint8 RGB array ``[H, W, 3]``; refuses huge or broken images."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=["PNG", "JPEG"])
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(
                    f"image has {width}x{height} = {width * height} pixels, more than the "
                    f"{max_pixels} pixel limit; downscale it"
                )
            if expected_format is not None and img.format != expected_format:
                logger.debug("data URL said %s but the bytes are %s", expected_format, img.format)
            img.load()
    except ImageError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageError(
            "image could not be decoded: the data is not a PNG or JPEG file (or it is corrupt)"
        ) from exc
    except (
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
        OSError,
        SyntaxError,
        ValueError,
    ) as exc:
        raise ImageError(f"image could not be decoded as PNG or JPEG: {exc}") from exc
    if img.mode != "RGB":
        if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            img = Image.alpha_composite(background, rgba)
        img = img.convert("RGB")
    return np.array(img, dtype=np.uint8)  # a writable copy (torch.as_tensor warns otherwise)


def resize_image(pixels: np.ndarray, *, token_cap: int = DEFAULT_IMAGE_TOKEN_CAP) -> np.ndarray:
    """Resize ``[H, W, 3]`` uint8 pixels to the :func:`smart_resize` target (bicubic)."""
    from PIL import Image

    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ImageError(f"expected uint8 pixels [H, W, 3], got {pixels.dtype} {pixels.shape}")
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    th, tw = smart_resize(height, width, token_cap=token_cap)
    if (th, tw) == (height, width):
        return np.ascontiguousarray(pixels)
    resized = Image.fromarray(pixels).resize((tw, th), Image.Resampling.BICUBIC)
    return np.array(resized, dtype=np.uint8)


def pixels_hash(pixels: np.ndarray) -> str:
    """sha256 over shape and pixel bytes: identical images share prefix-cache blocks."""
    h = hashlib.sha256()
    h.update(f"{pixels.shape[0]}x{pixels.shape[1]}x{pixels.shape[2]}:".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


def load_image_pixels(
    url: str,
    *,
    token_cap: int = DEFAULT_IMAGE_TOKEN_CAP,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[np.ndarray, str]:
    """Data URL → (resized pixels with H, W multiples of 28, content hash)."""
    data, fmt = decode_data_url(url, max_bytes=max_bytes)
    pixels = resize_image(
        decode_image(data, expected_format=fmt, max_pixels=max_pixels), token_cap=token_cap
    )
    return pixels, pixels_hash(pixels)


def load_image_input(
    url: str,
    *,
    token_cap: int = DEFAULT_IMAGE_TOKEN_CAP,
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> ImageInput:
    """Data URL → the engine's :class:`~engine.core.request.ImageInput`."""
    from engine.core.request import ImageInput

    pixels, digest = load_image_pixels(
        url, token_cap=token_cap, max_bytes=max_bytes, max_pixels=max_pixels
    )
    return ImageInput(pixels=pixels, content_hash=digest)


def encode_data_url(pixels: np.ndarray, fmt: str = "PNG") -> str:
    """uint8 ``[H, W, 3]`` → ``data:image/...;base64,...`` (for clients, tests and benchmarks)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    mime = "image/png" if fmt.upper() == "PNG" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"
