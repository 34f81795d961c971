"""Generated images are real, decodable PNG/JPEG of the requested size, and cached."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from loadgen.images import data_url, encoded


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_real_images(fmt: str) -> None:
    raw = encoded(160, 90, fmt, 3)
    img = Image.open(io.BytesIO(raw))
    assert img.format == fmt.upper() and img.size == (160, 90)
    arr = np.asarray(img.convert("L"), dtype=float)
    assert arr.std() > 5  # not flat
    assert np.abs(np.diff(arr, axis=1)).mean() < 20  # smooth: gradients and shapes, not noise
    url = data_url(160, 90, fmt, 3)
    assert base64.b64decode(url.split(",", 1)[1]) == raw
    assert data_url(160, 90, fmt, 3) is url  # cached
    assert encoded(160, 90, fmt, 4) != raw


def test_bad_format() -> None:
    with pytest.raises(ValueError):
        encoded(10, 10, "gif", 0)
