"""Deterministic prompt tokens: a prompt is a list of named segments, materialised on send.

A segment `(key, length)` always yields the first `length` tokens of one infinite, seeded sequence
per key, so shared prefixes (a chat system prompt, a RAG document, a Mooncake hash block) are the
same token ids in every request that names them, and a shorter use is a prefix of a longer one.
Token ids default to the printable range [32, 126], valid for byte-level tokenizers and nearly
every real vocabulary. Text fallback maps each id to a word, so shared prefixes stay shared as text.
"""

from __future__ import annotations

import logging
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

BLOCK = 256  # tokens per generated block; a sequence is the concatenation of its blocks

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass(frozen=True)
class Segment:
    """`length` tokens of the sequence named `key`; `shared` segments are cached."""

    key: str
    length: int
    shared: bool = False


class TokenSource:
    """Seeded token ids per segment key, in [lo, hi]; caches shared segments (bounded LRU)."""

    def __init__(self, seed: int, lo: int = 32, hi: int = 126, cache_tokens: int = 8_000_000):
        if not (0 <= lo <= hi):
            raise ValueError(f"token id range must satisfy 0 <= lo <= hi, got {lo},{hi}")
        self.seed, self.lo, self.hi = seed, lo, hi
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached = 0
        self._cache_tokens = cache_tokens

    def _block(self, key: str, index: int) -> np.ndarray:
        k = zlib.crc32(key.encode()) & 0xFFFFFFFF
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, k, index, len(key)])
        return rng.integers(self.lo, self.hi + 1, size=BLOCK, dtype=np.int32)

    def sequence(self, key: str, length: int) -> np.ndarray:
        """First `length` token ids of the sequence `key` (int32 array)."""
        if length <= 0:
            return np.zeros(0, dtype=np.int32)
        blocks = -(-length // BLOCK)
        return np.concatenate([self._block(key, i) for i in range(blocks)])[:length]

    def _shared(self, key: str, length: int) -> np.ndarray:
        got = self._cache.get(key)
        if got is not None and len(got) >= length:
            self._cache.move_to_end(key)
            return got[:length]
        seq = self.sequence(key, length)
        if got is not None:
            self._cached -= len(got)
        self._cache[key] = seq
        self._cached += len(seq)
        while self._cached > self._cache_tokens and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)
        return seq

    def tokens(self, segments: list[Segment] | tuple[Segment, ...]) -> list[int]:
        """The prompt's token ids: its segments concatenated."""
        parts = [
            self._shared(s.key, s.length) if s.shared else self.sequence(s.key, s.length)
            for s in segments
        ]
        if not parts:
            return []
        return np.concatenate(parts).tolist()

    def text(self, segments: list[Segment] | tuple[Segment, ...]) -> str:
        """Text fallback: one common English word per token id (about one token each)."""
        return ids_to_text(self.tokens(segments))


def ids_to_text(ids: list[int]) -> str:
    n = len(_WORDS)
    return " ".join(_WORDS[i % n] for i in ids)


def words(rng: np.random.Generator, count: int) -> str:
    """`count` random common words (VLM instructions, text fallbacks)."""
    idx = rng.integers(0, len(_WORDS), size=max(0, count))
    return " ".join(_WORDS[int(i)] for i in idx)
