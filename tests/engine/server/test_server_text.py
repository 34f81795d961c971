"""Incremental detokenization and stop strings (no server needed)."""

from __future__ import annotations

from engine.server.detokenize import IncrementalDetokenizer, TextAccumulator


class ByteTok:
    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _stream(text: str) -> list[str]:
    detok = IncrementalDetokenizer(ByteTok())
    out = [detok.add([b]) for b in text.encode()]
    out.append(detok.flush())
    return out


def test_multibyte_characters_are_held_until_complete() -> None:
    pieces = _stream("a€b")
    assert "".join(pieces) == "a€b"
    assert "\ufffd" not in "".join(pieces)
    assert pieces[:5] == ["a", "", "", "€", "b"]


def test_invalid_bytes_become_replacement_once() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    text = detok.add([0xC3]) + detok.add([0x41]) + detok.flush()
    assert text == "\ufffdA"
    dangling = IncrementalDetokenizer(ByteTok())
    assert dangling.add([0x41, 0xE2]) + dangling.flush() == "A\ufffd"


def test_special_tokens_skipped() -> None:
    detok = IncrementalDetokenizer(ByteTok())
    assert detok.add([104, 257]) + detok.flush() == "h"


def test_stop_string_truncates_and_holds_back() -> None:
    acc = TextAccumulator(["STOP"])
    emitted = []
    for piece in ["hel", "lo S", "TO", "P and more"]:
        acc.add(piece)
        emitted.append(acc.take(final=False))
    assert acc.stopped
    assert "".join(emitted) + acc.take(final=True) == "hello "
    assert all("S" not in e for e in emitted)


def test_no_stop_emits_everything() -> None:
    acc = TextAccumulator([])
    acc.add("abc")
    assert acc.take(final=False) == "abc"
    acc.add("d")
    assert acc.take(final=True) == "d" and not acc.stopped


def test_earliest_of_several_stops_wins() -> None:
    acc = TextAccumulator(["zz", "b"])
    acc.add("aazzb")
    assert acc.stopped and acc.take(final=True) == "aa"


def test_byte_fast_path_matches_generic_path() -> None:
    from engine.tokenizer import ByteTokenizer

    data = "héllo €uro ✓".encode() + b"\xc3A\xe2\x82"
    ids = list(data) + [257]
    fast, slow = IncrementalDetokenizer(ByteTokenizer()), IncrementalDetokenizer(ByteTok())
    fast_text = "".join(fast.add([i]) for i in ids) + fast.flush()
    slow_text = "".join(slow.add([i]) for i in ids) + slow.flush()
    assert fast_text == slow_text == data.decode("utf-8", errors="replace")
