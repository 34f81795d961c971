"""wire.strict_json: the one JSON rule of the engine's HTTP bodies and the collector's frames."""

from __future__ import annotations

import pytest

from wire import strict_json


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"a": [1, NaN]}'])
def test_nan_and_infinity_are_refused(text: str) -> None:
    with pytest.raises(strict_json.JSONRefused, match="NaN and Infinity"):
        strict_json.loads(text)


def test_depth_is_bounded_with_a_reason_never_recursion_error() -> None:
    limit = strict_json.MAX_DEPTH
    assert strict_json.loads("[" * limit + "]" * limit) is not None
    assert strict_json.loads(b'{"a": ' + b"[" * (limit - 1) + b"]" * (limit - 1) + b"}")
    for n in (limit + 1, 100_000):  # past the limit, and past Python's recursion limit
        with pytest.raises(strict_json.JSONRefused, match=f"deeper than {limit}"):
            strict_json.loads("[" * n + "]" * n)
    wide = "[" + ",".join(["[]"] * 1000) + "]"  # many brackets, shallow: accepted
    assert len(strict_json.loads(wide)) == 1000


def test_malformed_json_says_where() -> None:
    with pytest.raises(strict_json.JSONRefused, match="line 1 column"):
        strict_json.loads('{"a": ')
    with pytest.raises(UnicodeDecodeError):
        strict_json.loads(b'"\xff"')
