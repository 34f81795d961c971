"""Incremental detokenization and stop strings: token ids in, emit-safe text out."""

from __future__ import annotations

import codecs
from typing import Any


class IncrementalDetokenizer:
    """Turn token ids into text as they arrive, holding back incomplete UTF-8 / merges.

    The window trick from vLLM: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit the
    difference, unless the new text ends in U+FFFD (a multi-byte character still arriving).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # Byte-level tokenizers: an incremental UTF-8 decoder is exact and much cheaper.
        self._bytes = getattr(tokenizer, "decode_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, new_ids: list[int]) -> str:
        if self._bytes is not None:
            return str(self._utf8.decode(self._bytes(new_ids)))
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        if self._bytes is not None:
            return str(self._utf8.decode(b"", final=True))
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read])
        new_text = self._tok.decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text) :]


class TextAccumulator:
    """Output text so far; finds stop strings and holds back text that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, *, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else max(0, len(self.text) - self._hold)
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
