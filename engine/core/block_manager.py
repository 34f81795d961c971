"""Paged KV blocks with reference counts and prefix caching by chained block hashes. No torch.

A block holds ``block_size`` consecutive positions of one sequence. A full, computed block is
registered under the hash of (its parent block's hash, its tokens, the images it covers), so a
later request whose prompt starts with the same tokens reuses it instead of computing it again.
Free blocks keep their hash until they are handed out again (least recently freed first), so a
finished request's prefix stays cached for as long as the memory is not needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from engine.core.request import Request


def block_hash(parent: bytes, tokens: list[int], extra: tuple[str, ...] = ()) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    for key in extra:
        h.update(key.encode())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks in eviction order (front is handed out first).
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure_hashes(self, req: Request, num_full_blocks: int) -> None:
        """Extend ``req.block_hashes`` to cover its first ``num_full_blocks`` full blocks."""
        bs = self.block_size
        while len(req.block_hashes) < num_full_blocks:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else b""
            lo, hi = i * bs, (i + 1) * bs
            extra = tuple(
                img.content_hash
                for img, (start, n) in zip(req.images, req.image_spans, strict=True)
                if start < hi and start + n > lo
            )
            req.block_hashes.append(block_hash(parent, req.token_ids[lo:hi], extra))

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks already holding this request's leading full blocks (at least one token is
        always left to compute, since its logits are needed)."""
        if not self.enable_prefix_caching or req.block_ids:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._ensure_hashes(req, max_blocks)
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_to_allocate(self, req: Request, num_new_tokens: int, hits: Sequence[int]) -> int:
        """Free blocks consumed if ``num_new_tokens`` more tokens are scheduled for ``req``."""
        bs = self.block_size
        total = -(-(req.num_computed_tokens + len(hits) * bs + num_new_tokens) // bs)
        new = total - len(req.block_ids) - len(hits)
        if new < 0:
            new = 0
        if hits:  # (called for every token of every step: no generator for the common case)
            new += sum(1 for b in hits if self.ref_counts[b] == 0)
        return new

    def can_allocate(self, req: Request, num_new_tokens: int, hits: Sequence[int] = ()) -> bool:
        return self.num_blocks_to_allocate(req, num_new_tokens, hits) <= len(self.free_queue)

    # --- commands -----------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, hits: Sequence[int] = ()) -> None:
        """Take the cached ``hits`` and enough new blocks for ``num_new_tokens`` more tokens."""
        if not hits and -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) <= len(
            req.block_ids
        ):
            return  # the blocks it has hold them (most decode tokens): nothing to take
        hits = list(hits)
        if self.num_blocks_to_allocate(req, num_new_tokens, hits) > self.num_free_blocks:
            raise RuntimeError("allocate() called without can_allocate()")
        for b in hits:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
            req.block_ids.append(b)
        req.num_computed_tokens += len(hits) * self.block_size
        total = self.blocks_for(req.num_computed_tokens + num_new_tokens)
        while len(req.block_ids) < total:
            b, _ = self.free_queue.popitem(last=False)
            old = self.hashes[b]
            if old is not None:
                if self.cached.get(old) == b:
                    del self.cached[old]
                self.hashes[b] = None
            self.ref_counts[b] = 1
            req.block_ids.append(b)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of blocks that the last step filled with computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_registered_blocks:
            return  # no block filled since (hashes cover the registered blocks already)
        self._ensure_hashes(req, num_full)
        for i in range(req.num_registered_blocks, num_full):
            b = req.block_ids[i]
            if self.hashes[b] is not None:
                continue
            h = req.block_hashes[i]
            if h not in self.cached:
                self.cached[h] = b
                self.hashes[b] = h
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def free(self, req: Request) -> None:
        """Drop the request's references; tail blocks go first in the eviction order."""
        for b in reversed(req.block_ids):
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} freed twice"
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for b in list(self.free_queue):
            self.hashes[b] = None
        self.cached = {h: b for h, b in self.cached.items() if self.ref_counts[b] > 0}
