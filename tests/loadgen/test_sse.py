"""SSE parser edge cases: line endings, splits at every byte, comments, multi-line data."""

from __future__ import annotations

import pytest

from loadgen.sse import Event, SSEError, SSEParser

STREAM = (
    b": keep-alive comment\r\n"
    b'data: {"a":1}\r\n\r\n'
    b"data: first\ndata: second\n\n"
    b"event: error\ndata:no-space\r\r"
    b"id: 7\nretry: 10\ndata\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    Event('{"a":1}'),
    Event("first\nsecond"),
    Event("no-space", "error"),
    Event(""),
    Event("[DONE]"),
]


def _all(parts: list[bytes]) -> tuple[list[Event], bool]:
    p = SSEParser()
    out = [e for part in parts for e in p.feed(part)]
    tail, clean = p.flush()
    return out + tail, clean


def test_whole() -> None:
    assert _all([STREAM]) == (EXPECTED, True)


def test_split_at_every_byte() -> None:
    for k in range(1, len(STREAM)):
        assert _all([STREAM[:k], STREAM[k:]]) == (EXPECTED, True), k


def test_byte_by_byte() -> None:
    assert _all([STREAM[i : i + 1] for i in range(len(STREAM))]) == (EXPECTED, True)


def test_utf8_split_inside_character() -> None:
    raw = "data: héllo ✓\n\n".encode()
    assert _all([raw[:8], raw[8:]]) == ([Event("héllo ✓")], True)


def test_unterminated_tail_is_unclean() -> None:
    events, clean = _all([b"data: a\n\ndata: partial"])
    assert events == [Event("a"), Event("partial")] and clean is False
    events, clean = _all([b"data: a\n\n: trailing comment"])
    assert events == [Event("a")]


def test_blank_lines_and_comments_only() -> None:
    assert _all([b"\n\n: x\n\n\r\n"]) == ([], True)


def test_overlong_line() -> None:
    p = SSEParser()
    with pytest.raises(SSEError):
        for _ in range(20):
            p.feed(b"x" * (1024 * 1024))
