"""wire.strict_json: the one JSON rule of the engine's HTTP bodies and the collector's frames."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from wire import strict_json


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", '{"a": [1, NaN]}'])
def test_nan_and_infinity_are_refused(text: str) -> None:
    with pytest.raises(strict_json.JSONRefused, match="NaN and Infinity"):
        strict_json.loads(text)


@pytest.mark.parametrize(
    "text", ["1e999", "-1e999", '{"a": [1, 1e400]}', "1" + "0" * 400 + ".0", b"[2E+999]"]
)
def test_numbers_too_big_for_a_float_are_refused_not_read_as_infinity(text: str | bytes) -> None:
    with pytest.raises(strict_json.JSONRefused, match="not a finite number"):
        strict_json.loads(text)


def test_large_and_small_finite_floats_still_parse() -> None:
    assert strict_json.loads("[1e308, -1e308, 1e-999, 0.5]") == [1e308, -1e308, 0.0, 0.5]


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


def test_brackets_inside_strings_neither_add_nor_hide_depth() -> None:
    limit = strict_json.MAX_DEPTH
    # shallow, with many brackets and quotes in its strings: accepted
    text = '["' + "[" * 100 + '", "' + "{" * 100 + '", {"k": "\\"[[[[\\\\"}]'
    assert strict_json.loads(text)[1] == "{" * 100
    # deep, each level's string full of closing brackets: a count that ignored strings would
    # see the depth drop back to 1 at every level
    deep = '["]}",' * (limit + 1) + "0" + "]" * (limit + 1)
    with pytest.raises(strict_json.JSONRefused, match=f"deeper than {limit}"):
        strict_json.loads(deep)
    # the same with escaped quotes and backslashes in those strings, and as UTF-8 bytes
    deep = '["\\\\\\"]\\\\",' * (limit + 1) + "0" + "]" * (limit + 1)
    with pytest.raises(strict_json.JSONRefused, match=f"deeper than {limit}"):
        strict_json.loads(deep.encode())
    ok = '["\\\\\\"]\\\\",' * limit + "0" + "]" * limit
    assert strict_json.loads(ok.encode())


def _random_json(rng: random.Random, depth: int) -> Any:
    """A random JSON value whose strings are made of the characters that matter to a scan."""
    roll = rng.random()
    if depth > 0 and roll < 0.35:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if depth > 0 and roll < 0.7:
        return {
            "".join(rng.choices('[]{}"\\ aé', k=rng.randint(0, 4))): _random_json(rng, depth - 1)
            for _ in range(rng.randint(0, 3))
        }
    if roll < 0.85:
        return "".join(rng.choices('[]{}"\\ /aé\n', k=rng.randint(0, 6)))
    return rng.choice([0, -1, 2**70, 1.5, True, None])


def test_the_text_scan_agrees_with_a_walk_of_the_parsed_value() -> None:
    rng = random.Random(18)
    told = 0
    for i in range(3000):
        value = _random_json(rng, rng.randint(1, 12))
        text = json.dumps(value, ensure_ascii=i % 2 == 0, separators=(",", ":") if i % 3 else None)
        for limit in (1, 3, 6, 10):
            want = isinstance(value, (dict, list)) and strict_json.depth_over(value, limit)
            got = strict_json.text_depth_over(text.encode(), limit)
            assert got in (None, want), (text, limit)
        if strict_json.text_depth_over(text.encode(), 1) is not None:
            told += 1
        if isinstance(value, (dict, list)) and strict_json.depth_over(value, 6):
            with pytest.raises(strict_json.JSONRefused, match="deeper than 6"):
                strict_json.loads(text, max_depth=6)
        else:
            assert strict_json.loads(text, max_depth=6) == value
    # the scan answers by itself for most texts (it falls back only for a bracket in a string)
    assert told > 1000


def test_a_frame_without_brackets_in_its_strings_is_read_from_the_text_alone() -> None:
    frame = {
        "events": [{"seq": i, "chunks": [{"request_id": f"r{i}", "start": 0}]} for i in range(50)]
    }
    text = json.dumps(frame).encode()
    assert strict_json.text_depth_over(text, 5) is False
    assert strict_json.text_depth_over(text, 4) is True
