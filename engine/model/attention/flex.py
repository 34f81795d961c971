"""FlexAttention (``torch.nn.attention.flex_attention``) reading K/V in place from the paged cache.

Layout
------
A layer's cache ``[num_blocks, block_size, Hkv, D]`` is handed to flex_attention as the permuted
view ``[1, Hkv, num_blocks * block_size, D]`` (no copy): every cache slot is one KV position of a
single "physical" sequence, and a block mask built from the block table says which slots a query
row reads. One sparse KV block of the mask is one cache block, so ``kv_indices`` are physical block
ids, built directly with ``BlockMask.from_kv_blocks`` (``create_block_mask`` over the whole cache
would evaluate Q x num_slots mask entries every step).

Inside a listed block the ``mask_mod`` maps a physical slot to the sequence's logical position
through ``page_logical[num_blocks]``, the logical block index of every block the step touches
(prefix caching keeps a shared block at the same logical index in every sequence, checked in
``prepare_metadata``; untouched blocks map to 0)::

    block = kv_idx // bs
    pos = page_logical[block] * bs + kv_idx % bs
    keep = (table[b, page_logical[block]] == block) & (pos <= q_base[b] + q_idx)

``table`` is ``[B, W]`` (block ids by logical index, padded with -1) with one width W per step,
at least the step's longest context in blocks, so any ``page_logical`` value indexes it. The
ownership test makes the mask exact on its own, which eager flex needs: eager flex (the CPU
default) is a dense reference that ignores the block lists and applies ``mask_mod`` to all
Q x num_slots scores. Compiled kernels (Triton, and Inductor's C++ template) only visit the listed
blocks, all owned by the row's sequence: blocks wholly below the causal diagonal go to
``full_kv_*`` (no mask evaluation), the diagonal ones to ``kv_*``.

Calls per step: one per prefill chunk (q ``[1, Hq, Lpad, D]``, sparse Q blocks of 128 rows, each
Q block listing only the pages within its causal reach) and ONE for all decode rows (q
``[Bpad, Hq, 1, D]`` against the batch-1 K/V view, which flex broadcasts when the block mask has
the query's batch size). A chunk of one token is a decode row. GQA via ``enable_gqa=True``; the
scale is flex's default ``1/sqrt(D)``, as SDPA's.

Compilation
-----------
* CUDA: always compiled (eager flex on CUDA would be the dense reference; an explicit
  ``compile=False`` is allowed for debugging and logs a warning). Two module-level
  ``torch.compile(..., dynamic=False, fullgraph=True)`` wrappers around ``flex_attention``, one for
  prefill chunks and one for decodes: distinct code objects, so each has its own recompile budget;
  ``fullgraph=True`` makes a blown budget an error instead of a silent eager fallback, and the
  budget (``torch._dynamo.config.recompile_limit``) is raised to at least 32 when a compiled
  backend is built.
* CPU: eager flex by default (exact; it still traces through Dynamo's eager backend once per new
  shape). ``CHUNKSCOPE_FLEX_COMPILE=1`` or ``FlexBackend(compile=True)`` compiles it with Inductor's
  C++ flex template, which requires ``kv_indices`` as wide as the whole cache; that mode pads every
  index width to ``num_blocks``.

Avoiding recompiles (CUDA): every shape that reaches the compiled call is bucketed.
* prefill: the chunk's q is zero-padded to a power of two >= 128 rows (the extra rows list no
  blocks, so the kernel skips them; their output is dropped) -> one graph per length bucket;
* decode: the batch is padded to a power of two >= 8 rows by repeating a real row, padded rows list
  no blocks -> one graph per batch bucket, and the batch stays static, which flex needs to pick its
  split-KV decoding kernel;
* the block-list width (``full_kv_indices``, and the ``table`` the mask reads) is one width per
  step, a power of two >= 8, and marked dynamic (``torch._dynamo.mark_dynamic``), so context
  growth never recompiles; the diagonal lists have a static width (1 for decodes,
  ``128 // block_size + 2`` for prefills); ``page_logical`` is always ``[num_blocks]``.
With a token budget of 8192 and 256 sequences that is at most 7 + 6 graphs, compiled on first use.

Kernel block sizes (CUDA): the Triton kernels need the sparse KV block (= the cache block) to be a
multiple of their BLOCK_N tile (a power of two <= 128 picked per GPU, dtype and head dim) and 128
(the sparse Q block) to be a multiple of BLOCK_M. Block sizes that are multiples of 128 work with
the default tiles; other multiples of 16 get ``kernel_options={"BLOCK_N": gcd(block_size, 64)}``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from engine.model.attention.common import (
    AttentionMetadata,
    SeqSlice,
    block_table,
    slot_mapping,
    store_kv,
)

logger = logging.getLogger(__name__)

FLEX_COMPILE_ENV = "CHUNKSCOPE_FLEX_COMPILE"
Q_BLOCK = 128  # sparse Q block of the prefill masks (flex's default; a multiple of any BLOCK_M)
MIN_DECODE_BUCKET = 8
MIN_WIDTH_BUCKET = 8
MIN_RECOMPILE_LIMIT = 32


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def check_block_size(device: torch.device, block_size: int) -> None:
    """Raise a ValueError if flex's kernels on ``device`` cannot read cache blocks of this size."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if device.type == "cuda" and block_size % 16:
        raise ValueError(
            "the flex attention backend on CUDA needs block_size % 16 == 0 (one cache block is "
            "one sparse KV block of FlexAttention's Triton kernels, which must be a multiple of "
            f"their BLOCK_N tile of 16 to 128 positions), got {block_size}"
        )


def kernel_options_for(device: torch.device, block_size: int) -> dict[str, Any] | None:
    """Triton tile override for cache blocks that are not a multiple of 128 (see module doc)."""
    if device.type != "cuda" or block_size % 128 == 0:
        return None
    return {"BLOCK_N": math.gcd(block_size, 64)}


def paged_causal_mask(
    page_logical: torch.Tensor, table: torch.Tensor, q_base: torch.Tensor, block_size: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """mask_mod over physical cache slots: keep slot ``kv_idx`` for query ``q_idx`` of batch row
    ``b`` if its block belongs to that row's sequence (``table[b]``, padded with -1) and its logical
    position is at most the query's position ``q_base[b] + q_idx``."""

    def mask_mod(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = kv_idx // block_size
        logical = page_logical[block]
        owned = table[b, logical] == block
        return owned & (logical * block_size + kv_idx % block_size <= q_base[b] + q_idx)

    return mask_mod


# Two wrappers with their own code objects, hence their own Dynamo caches and recompile budgets.
def _flex_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    kernel_options: dict[str, Any] | None,
) -> torch.Tensor:
    return flex_attention(  # type: ignore[return-value]
        q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options
    )


def _flex_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    kernel_options: dict[str, Any] | None,
) -> torch.Tensor:
    return flex_attention(  # type: ignore[return-value]
        q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options
    )


# The compiled entry points (torch.compile is lazy: nothing compiles until the first call).
flex_prefill_compiled = torch.compile(_flex_prefill, dynamic=False, fullgraph=True)
flex_decode_compiled = torch.compile(_flex_decode, dynamic=False, fullgraph=True)
_OTHER_COMPILED: dict[tuple[str, Any], Callable[..., torch.Tensor]] = {}


def compiled_flex(kind: str, backend: Any = "inductor") -> Callable[..., torch.Tensor]:
    """The compiled prefill or decode call (another Dynamo backend: for tests)."""
    if backend == "inductor":
        return flex_prefill_compiled if kind == "prefill" else flex_decode_compiled
    key = (kind, backend)
    if key not in _OTHER_COMPILED:
        fn = _flex_prefill if kind == "prefill" else _flex_decode
        _OTHER_COMPILED[key] = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
    return _OTHER_COMPILED[key]


@dataclass
class _Lists:
    """Block lists of one flex call (host tensors until the step's first layer)."""

    num: torch.Tensor  # [B, 1, R] diagonal (masked) blocks per Q block
    idx: torch.Tensor  # [B, 1, R, P]
    full_num: torch.Tensor  # [B, 1, R] blocks wholly below the diagonal
    full_idx: torch.Tensor  # [B, 1, R, W]
    table: torch.Tensor  # [B, W] each row's blocks by logical index, padded with -1
    q_base: torch.Tensor  # [B] position of query row 0


@dataclass
class FlexPrefill:
    q_start: int
    q_len: int
    padded_len: int
    lists: _Lists
    block_mask: BlockMask | None = None


@dataclass
class FlexDecode:
    rows: torch.Tensor  # [B] query rows
    padded_rows: torch.Tensor  # [Bpad] rows, the padding repeating rows[0]
    lists: _Lists
    block_mask: BlockMask | None = None


@dataclass
class FlexMetadata(AttentionMetadata):
    flex_prefills: list[FlexPrefill] = field(default_factory=list)
    flex_decode: FlexDecode | None = None
    block_size: int = 0
    width: int = 0  # the step's block-list width W
    touched_blocks: torch.Tensor | None = None  # physical ids of the step's context blocks
    touched_logical: torch.Tensor | None = None  # and their logical indices
    ready: bool = False  # block masks built (on the step's first layer)


class FlexBackend:
    """FlexAttention over the paged KV cache; see the module docstring for layout and compilation.

    ``compile``: None = compiled on CUDA, and on CPU only if ``CHUNKSCOPE_FLEX_COMPILE=1``.
    ``compile_backend``: the Dynamo backend of the compiled mode (tests use non-Inductor ones).
    """

    name = "flex"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
        *,
        compile: bool | None = None,
        compile_backend: Any = "inductor",
    ) -> None:
        self.device = torch.device(device)
        if block_size is not None:
            check_block_size(self.device, block_size)
        if compile is None:
            compile = self.device.type == "cuda" or os.environ.get(FLEX_COMPILE_ENV, "") == "1"
        elif not compile and self.device.type == "cuda":
            logger.warning(
                "flex attention on CUDA without torch.compile: dense reference, not fast"
            )
        self.compiled = compile
        self.compile_backend = compile_backend
        # Inductor's C++ flex template reads kv_indices as wide as the whole cache.
        self.dense_widths = compile and self.device.type == "cpu" and compile_backend == "inductor"
        if compile:
            cfg = torch._dynamo.config
            if cfg.recompile_limit < MIN_RECOMPILE_LIMIT:
                logger.info(
                    "flex: raising torch._dynamo.config.recompile_limit %d -> %d",
                    cfg.recompile_limit,
                    MIN_RECOMPILE_LIMIT,
                )
                cfg.recompile_limit = MIN_RECOMPILE_LIMIT

    # --- per step -----------------------------------------------------------------------------
    def prepare_metadata(
        self, seqs: list[SeqSlice], block_size: int, device: torch.device
    ) -> FlexMetadata:
        check_block_size(device, block_size)
        bs = block_size
        table0 = block_table(seqs, bs)  # [S, maxb], padded with 0
        n_blocks = torch.tensor([-(-s.ctx_len // bs) for s in seqs])
        cols = torch.arange(table0.shape[1])
        valid = cols.unsqueeze(0) < n_blocks.unsqueeze(1)
        table = torch.where(valid, table0, -1).to(torch.int32)  # padded with -1
        width = bucket(int(n_blocks.max()), MIN_WIDTH_BUCKET)
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]), value=-1)
        touched = table0[valid]
        logical = cols.expand_as(table0)[valid]
        _check_shared_blocks(touched, logical)
        meta = FlexMetadata(
            num_tokens=sum(s.q_len for s in seqs),
            slot_mapping=slot_mapping(seqs, bs).to(device),
            block_size=bs,
            width=width,
            touched_blocks=touched,
            touched_logical=logical.to(torch.int32),
        )
        decode_rows = [i for i, s in enumerate(seqs) if s.q_len == 1]
        for i, s in enumerate(seqs):
            if s.q_len > 1:
                meta.flex_prefills.append(self._prefill_lists(s, table[i], bs))
        if decode_rows:
            meta.flex_decode = self._decode_lists(seqs, decode_rows, table, bs)
        return meta

    def _prefill_lists(self, s: SeqSlice, row: torch.Tensor, bs: int) -> FlexPrefill:
        """Q blocks of 128 rows; Q block r (positions p0..p1) lists the blocks wholly at or below
        p0 as full and the blocks from there up to p1's block as diagonal."""
        start = s.ctx_len - s.q_len
        padded = bucket(s.q_len, Q_BLOCK)
        r = torch.arange(padded // Q_BLOCK)
        real = r * Q_BLOCK < s.q_len
        p0 = start + r * Q_BLOCK
        p1 = start + torch.clamp((r + 1) * Q_BLOCK - 1, max=s.q_len - 1)
        n_full = torch.where(real, (p0 + 1) // bs, 0)
        n_diag = torch.where(real, p1 // bs - n_full + 1, 0)
        width = row.shape[0]
        ids = row.clamp(min=0)  # list padding must still be a valid block id
        diag_w = Q_BLOCK // bs + 2
        diag_cols = torch.clamp(n_full.unsqueeze(1) + torch.arange(diag_w), max=width - 1)
        lists = _Lists(
            num=n_diag.to(torch.int32).view(1, 1, -1),
            idx=ids[diag_cols].view(1, 1, -1, diag_w),
            full_num=n_full.to(torch.int32).view(1, 1, -1),
            full_idx=ids.expand(len(r), width).reshape(1, 1, len(r), width),
            table=row.view(1, width).clone(),  # not a view into the step's table
            q_base=torch.tensor([start], dtype=torch.int32),
        )
        return FlexPrefill(s.q_start, s.q_len, padded, lists)

    def _decode_lists(
        self, seqs: list[SeqSlice], rows: list[int], table: torch.Tensor, bs: int
    ) -> FlexDecode:
        """One row per decode: its full blocks, and its last block as the diagonal one if that
        block is partly filled. Padding rows list nothing."""
        n, padded = len(rows), bucket(len(rows), MIN_DECODE_BUCKET)
        ctx = torch.tensor([seqs[i].ctx_len for i in rows])
        tab = torch.full((padded, table.shape[1]), -1, dtype=torch.int32)
        tab[:n] = table[rows]
        ids = tab.clamp(min=0)
        n_full = torch.zeros(padded, dtype=torch.int32)
        n_full[:n] = (ctx // bs).to(torch.int32)
        n_diag = torch.zeros(padded, dtype=torch.int32)
        n_diag[:n] = (ctx % bs != 0).to(torch.int32)
        last = torch.clamp(n_full.long(), max=tab.shape[1] - 1).unsqueeze(1)
        q_base = torch.full((padded,), -1, dtype=torch.int32)
        q_base[:n] = (ctx - 1).to(torch.int32)
        q_rows = torch.tensor([seqs[i].q_start for i in rows], dtype=torch.long)
        lists = _Lists(
            num=n_diag.view(padded, 1, 1),
            idx=ids.gather(1, last).view(padded, 1, 1, 1),
            full_num=n_full.view(padded, 1, 1),
            full_idx=ids.view(padded, 1, 1, -1),
            table=tab,
            q_base=q_base,
        )
        padded_rows = torch.cat([q_rows, q_rows[:1].expand(padded - n)])
        return FlexDecode(q_rows, padded_rows, lists)

    def _finish(self, meta: FlexMetadata, num_blocks: int, device: torch.device) -> None:
        """Move the step's lists to the device and build its block masks (first layer only)."""
        assert meta.touched_blocks is not None and meta.touched_logical is not None
        bs = meta.block_size
        page_logical = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        page_logical[meta.touched_blocks.to(device)] = meta.touched_logical.to(device)
        calls: list[FlexPrefill | FlexDecode] = [*meta.flex_prefills]
        if meta.flex_decode is not None:
            calls.append(meta.flex_decode)
        for call in calls:
            lists = self._to_device(call.lists, num_blocks, device)
            q_len = call.padded_len if isinstance(call, FlexPrefill) else 1
            call.block_mask = BlockMask.from_kv_blocks(
                lists.num,
                lists.idx,
                lists.full_num,
                lists.full_idx,
                BLOCK_SIZE=(Q_BLOCK, bs),
                mask_mod=paged_causal_mask(page_logical, lists.table, lists.q_base, bs),
                seq_lengths=(q_len, num_blocks * bs),
                compute_q_blocks=False,  # the q-side lists serve only the backward pass
            )
            if isinstance(call, FlexDecode):
                call.rows = call.rows.to(device)
                call.padded_rows = call.padded_rows.to(device)
        meta.ready = True

    def _to_device(self, lists: _Lists, num_blocks: int, device: torch.device) -> _Lists:
        if self.dense_widths:  # Inductor's CPU template: index lists as wide as the cache

            def widen(t: torch.Tensor, value: int) -> torch.Tensor:
                return torch.nn.functional.pad(t, (0, num_blocks - t.shape[-1]), value=value)

            lists = _Lists(
                lists.num,
                widen(lists.idx, 0),
                lists.full_num,
                widen(lists.full_idx, 0),
                widen(lists.table, -1),
                lists.q_base,
            )
        out = _Lists(*(t.to(device).contiguous() for t in vars(lists).values()))
        if self.compiled and not self.dense_widths:
            # One width per step, dynamic: context growth never recompiles.
            torch._dynamo.mark_dynamic(out.full_idx, 3)
            torch._dynamo.mark_dynamic(out.table, 1)
        return out

    # --- per layer ----------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, FlexMetadata), "FlexBackend needs its own prepare_metadata"
        num_blocks, bs, num_kv_heads, head_dim = k_cache.shape
        if not meta.ready:
            self._finish(meta, num_blocks, q.device)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # [num_blocks, bs, Hkv, D] -> [1, Hkv, num_slots, D]: a view, no copy.
        kv_shape = (1, num_blocks * bs, num_kv_heads, head_dim)
        ks = k_cache.view(kv_shape).permute(0, 2, 1, 3)
        vs = v_cache.view(kv_shape).permute(0, 2, 1, 3)
        options = kernel_options_for(q.device, bs)
        out = torch.empty_like(q)
        for p in meta.flex_prefills:
            qp = q.new_zeros(p.padded_len, q.shape[1], q.shape[2])
            qp[: p.q_len] = q[p.q_start : p.q_start + p.q_len]
            o = self._call("prefill", qp.permute(1, 0, 2).unsqueeze(0), ks, vs, p, options)
            out[p.q_start : p.q_start + p.q_len] = o[0, :, : p.q_len].transpose(0, 1)
        d = meta.flex_decode
        if d is not None:
            qd = q.index_select(0, d.padded_rows).unsqueeze(2)  # [Bpad, Hq, 1, D]
            o = self._call("decode", qd, ks, vs, d, options)
            out.index_copy_(0, d.rows, o[: d.rows.shape[0], :, 0])
        return out

    def _call(
        self,
        kind: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: FlexPrefill | FlexDecode,
        options: dict[str, Any] | None,
    ) -> torch.Tensor:
        if self.compiled:
            fn = compiled_flex(kind, self.compile_backend)
        else:
            fn = _flex_prefill if kind == "prefill" else _flex_decode
        return fn(q, k, v, call.block_mask, options)


def _check_shared_blocks(blocks: torch.Tensor, logical: torch.Tensor) -> None:
    """``page_logical`` is one array per step: a block in several sequences (prefix caching) must
    sit at the same logical index in each of them."""
    if blocks.numel() == 0:
        return
    seen = torch.full((int(blocks.max()) + 1,), -1, dtype=logical.dtype)
    seen[blocks] = logical
    if bool((seen[blocks] != logical).any()):
        raise RuntimeError("a KV block is shared at different logical positions in one step")
