"""Real PNG/JPEG test images (gradients and shapes, not noise), cached per (size, format, variant).

Gradients and flat shapes compress like photos and screenshots do, so upload sizes are realistic;
noise would not be. Generation is cached so it never throttles the sender.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

logger = logging.getLogger(__name__)

FORMATS = ("png", "jpeg")
_lock = threading.Lock()


def render(width: int, height: int, variant: int) -> Image.Image:
    """A deterministic RGB image: a two-colour gradient plus a few filled shapes."""
    if width <= 0 or height <= 0:
        raise ValueError(f"bad image size {width}x{height}")
    rng = np.random.default_rng([width, height, variant])
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    angle = rng.uniform(0, 2 * np.pi)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    proj = xs * np.cos(angle) / width + ys * np.sin(angle) / height
    proj = (proj - proj.min()) / max(float(np.ptp(proj)), 1e-6)
    arr = c0[None, None, :] * (1 - proj[..., None]) + c1[None, None, :] * proj[..., None]
    img = Image.fromarray(arr.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 9))):
        x0, x1 = sorted(rng.integers(0, width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, height, size=2).tolist())
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        shape = int(rng.integers(0, 3))
        if shape == 0:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        elif shape == 1:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        else:
            draw.line((x0, y0, x1, y1), fill=colour, width=max(1, width // 100))
    return img


@lru_cache(maxsize=256)
def encoded(width: int, height: int, fmt: str, variant: int) -> bytes:
    """The image encoded as PNG or JPEG bytes (cached)."""
    if fmt not in FORMATS:
        raise ValueError(f"image format must be one of {FORMATS}, got {fmt!r}")
    buf = io.BytesIO()
    img = render(width, height, variant)
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=3)
    else:
        img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


@lru_cache(maxsize=256)
def data_url(width: int, height: int, fmt: str, variant: int) -> str:
    """`data:image/...;base64,...` URL for an OpenAI `image_url` content part (cached)."""
    with _lock:
        raw = encoded(width, height, fmt, variant)
    return f"data:image/{fmt};base64,{base64.b64encode(raw).decode('ascii')}"
