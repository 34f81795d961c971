"""The split backend (CPU default): a chunk's attention over its cached prefix with no mask,
plus its causal diagonal, merged by log-sum-exp.

A prefill chunk of ``q_len`` queries at positions ``[start, ctx_len)`` attends to the prefix
``[0, start)`` in full and to its own keys causally. SDPA with one offset boolean mask makes the
CPU kernel read and apply a ``[q_len, ctx_len]`` mask it had to build first (the mask costs ~20%
of the attention at a 6,000-token context, measured). Here the two parts are two calls of the
fused CPU flash kernel, neither with a mask, each returning the log-sum-exp of its rows, and the
two partial outputs are merged exactly (``merge``):

* prefix: the ``G = Hq / Hkv`` query heads that share a K/V head are stacked as rows of one
  query ``[1, Hkv, G * q_len, D]``, so the K/V heads are used as they are (no repeat) and one
  call serves all of a group's query heads. The K/V come from the paged cache: a view of the
  flat cache when the prefix's blocks are one run of consecutive block ids (no copy), else one
  ``index_select`` of the prefix's slots (a gather of ``start x Hkv x D``, ~1% of the call);
* diagonal: ``is_causal=True`` against the chunk's own K/V (the step's inputs: the very values
  just written to the cache), its K/V heads repeated for their query heads (``q_len`` rows).

On CPUs with AMX-BF16, in bf16 with one torch thread and head dim 64, none of the above runs:
one call of our kernel per layer (``amx.attention_paged``) takes the whole step, every chunk
causally over its prefix and its own keys in one online softmax (no merge) and every decode,
reading K/V through the block table (no gather, no mask); the torch path's metadata is then not
built (``SplitMetadata.torch_parts``, built on first use). ``CHUNKSCOPE_AMX_ATTENTION=0`` turns
the kernel off.

Where AMX does not take the step, on CPUs with AVX-512 (fp32 or bf16, head dim 64 or 128, any
number of torch threads: the kernel shares the step out to them), the whole step goes to our
AVX-512 kernel the same way: one call per layer, each chunk causally over its prefix and own
keys in one online softmax, each decode's query heads over its keys, K/V read through the block
table (``vec.attention_paged``; ``CHUNKSCOPE_VEC_ATTENTION=0`` turns it off).

A chunk at position 0 is one causal call. Decodes (one query each) are served by the paged
decode kernel (``paged_decode``: C, reads each sequence's K/V in place through its block table,
fp32 and bf16, on the torch threads; ``CHUNKSCOPE_DECODE_KERNEL=0`` turns it off). Where it cannot
run, they are batched in groups of similar context length (padding at most doubles a row's
keys), the group's query heads stacked the same way (``[B, Hkv, G, D]``), K/V gathered from the
flat cache by the step's slot table; a group whose lengths differ gets a ``[B, 1, 1, L]``
key-padding mask, built once per step and shared by every layer. A group of equal lengths has
none.

The kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``, what
``F.scaled_dot_product_attention`` dispatches to on CPU) accumulates in fp32 for bf16 inputs
and returns its log-sum-exp in fp32; the merge runs in fp32. When torch lacks the op,
``split_available()`` is False and ``select`` falls back to SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.attention import amx, paged_decode, vec
from engine.model.attention.common import (
    AttentionMetadata,
    SeqSlice,
    block_table,
    context_slots,
    decode_groups,
    slot_mapping,
    store_kv,
)


def _flash_op():  # type: ignore[no-untyped-def]
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def split_available() -> bool:
    """Whether this torch has the fused CPU flash kernel that returns log-sum-exp."""
    return _flash_op() is not None


@dataclass
class SplitPrefill:
    seq: SeqSlice
    # the prefix [0, start) in the flat cache: a (first, end) slot range when its blocks are
    # consecutive (read as a view), else its slots (gathered); None for a chunk at position 0
    prefix_range: tuple[int, int] | None = None
    prefix_slots: torch.Tensor | None = None


@dataclass
class PagedDecodes:
    """The step's decodes for the in-place kernel (``paged_decode``): query rows, block table
    rows and context lengths, int64 ``[B]`` / ``[B, W]`` / ``[B]``."""

    rows: torch.Tensor
    table: torch.Tensor
    ctx_lens: torch.Tensor
    seqs: list[tuple[int, SeqSlice]]  # (row in the step's table, slice): the fallback's input


@dataclass
class SplitMetadata(AttentionMetadata):
    split_prefills: list[SplitPrefill] = field(default_factory=list)
    # for the whole-step kernels (AMX, AVX-512): int32 [S, 3] (q_start, q_len, ctx_len) of every
    # sequence (its block ids in ``block_table``)
    seq_info: torch.Tensor | None = None
    seqs: list[SeqSlice] = field(default_factory=list)
    block_size: int = 16
    torch_built: bool = False
    ranges_checked: bool = False  # a whole-step call's rows and block ids (once per step)
    # the torch path's decodes for the in-place kernel; ``decode_groups`` is then built only if
    # a layer cannot use it (once, from ``paged.seqs``)
    paged: PagedDecodes | None = None

    def torch_parts(self, decode_kernel: bool = False) -> SplitMetadata:
        """Build (once) what the torch path needs: each chunk's prefix location, and the
        decodes for the in-place kernel (``decode_kernel``) or else their groups' slots and
        masks. Not built when the AMX kernel takes the whole step."""
        if self.torch_built:
            return self
        self.torch_built = True
        seqs, block_size, table = self.seqs, self.block_size, self.block_table
        assert table is not None
        decodes: list[tuple[int, SeqSlice]] = []
        for row, s in enumerate(seqs):
            if s.q_len == 1:
                decodes.append((row, s))
                continue
            rng, slots = prefix_location(s, block_size, table[row : row + 1])
            self.split_prefills.append(SplitPrefill(s, rng, slots))
        if decodes and decode_kernel:
            rows = torch.tensor([s.q_start for _, s in decodes], dtype=torch.long)
            sub = table[[row for row, _ in decodes]].contiguous()
            lens = torch.tensor([s.ctx_len for _, s in decodes], dtype=torch.long)
            self.paged = PagedDecodes(rows, sub, lens, decodes)
        else:
            self.decode_groups = decode_groups(decodes, table, block_size)
        return self


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> torch.Tensor:
    """Softmax attention over the union of two disjoint key sets, from each set's output
    ``[..., L, D]`` and log-sum-exp ``[..., L]``, in fp32."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1.float() * w1 + o2.float() * w2


def prefix_location(
    s: SeqSlice, block_size: int, table_row: torch.Tensor
) -> tuple[tuple[int, int] | None, torch.Tensor | None]:
    """Where the prefix ``[0, start)`` of ``s`` lies in the flat cache (see ``SplitPrefill``)."""
    start = s.ctx_len - s.q_len
    if start == 0:
        return None, None
    n_blocks = -(-start // block_size)
    ids = s.block_ids[:n_blocks]
    if ids == list(range(ids[0], ids[0] + n_blocks)):
        first = ids[0] * block_size
        return (first, first + start), None
    return None, context_slots(table_row, block_size, start)[0]


class SplitBackend:
    name = "split"

    def __init__(self) -> None:
        op = _flash_op()
        if op is None:
            raise RuntimeError(
                "the split attention backend needs torch's fused CPU flash kernel "
                "(aten::_scaled_dot_product_flash_attention_for_cpu); use --attention-backend sdpa"
            )
        self._op = op
        # the AMX bf16 kernel for the prefix (engine/model/attention/amx.py) where it can run
        self._amx = amx.enabled()
        # the whole step in one paged kernel call (False: the kernel serves only the prefix
        # call, as before; benchmarks/attention_step.py's split-prefix arm)
        self.amx_paged = True
        # the torch path's decodes read in place from the cache (attention/paged_decode.py)
        self._decode_kernel = paged_decode.enabled()
        # the whole step on the AVX-512 kernel where AMX does not take it (attention/vec.py;
        # CHUNKSCOPE_VEC_ATTENTION=0 turns it off)
        self._vec = vec.enabled()

    def _paged_ready(self) -> bool:
        """Whether a step will go to one of the whole-step kernels, AMX (bf16) or AVX-512 (then
        the torch path's metadata is built only if a layer falls back to it)."""
        one = torch.get_num_threads() == 1
        if self._amx and self.amx_paged and one and amx.prefix_kernel() is not None:
            return True
        return self._vec and vec.available()

    def prepare_metadata(
        self, seqs: list[SeqSlice], block_size: int, device: torch.device
    ) -> SplitMetadata:
        if device.type != "cpu":
            raise ValueError("the split attention backend runs on CPU only")
        table = block_table(seqs, block_size)
        meta = SplitMetadata(
            num_tokens=sum(s.q_len for s in seqs),
            slot_mapping=slot_mapping(seqs, block_size),
            block_table=table,
            seq_info=torch.tensor(
                [(s.q_start, s.q_len, s.ctx_len) for s in seqs], dtype=torch.int32
            ).view(-1, 3),
            seqs=seqs,
            block_size=block_size,
        )
        if not self._paged_ready():
            meta.torch_parts(self._decode_ready())
        return meta

    def _decode_ready(self) -> bool:
        """Whether the torch path's decodes go to the in-place decode kernel."""
        if not self._decode_kernel:
            return False
        dll = paged_decode.decode_kernel()
        if dll is None:
            return False
        return torch.get_num_threads() == 1 or bool(dll.paged_decode_threaded())

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert isinstance(meta, SplitMetadata)
        groups = q.shape[1] // k_cache.shape[2]
        k_flat, v_flat = store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if self._amx and self.amx_paged and meta.seq_info is not None and amx.usable(q, k_cache):
            # every sequence (chunks and decodes) in one call, K/V read through the block table
            amx.attention_paged(
                q, k_cache, v_cache, meta.seq_info, meta.block_table, out,
                check_ranges=not meta.ranges_checked,
            )  # fmt: skip
            meta.ranges_checked = True  # every layer's cache has the same shape
            return out
        if self._vec and meta.seq_info is not None and vec.usable(q, k_cache):
            # the same on AVX-512 FMA (fp32 arithmetic), where AMX does not take the step
            vec.attention_paged(
                q, k_cache, v_cache, meta.seq_info, meta.block_table, out,
                check_ranges=not meta.ranges_checked,
            )  # fmt: skip
            meta.ranges_checked = True
            return out
        meta.torch_parts(self._decode_ready())
        self._torch_chunks(q, k, v, k_flat, v_flat, meta, out, groups)
        return self._decodes(q, k_cache, k_flat, v_flat, meta, out)

    def _torch_chunks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: SplitMetadata,
        out: torch.Tensor,
        groups: int,
    ) -> None:
        """The chunks through torch's flash kernel: prefix and diagonal, merged."""
        num_heads = q.shape[1]
        num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
        for p in meta.split_prefills:
            s = p.seq
            rows = slice(s.q_start, s.q_start + s.q_len)
            qs = q[rows]  # [L, Hq, D]
            ks = k[rows].repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
            vs = v[rows].repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
            diag, lse_diag = self._op(qs.transpose(0, 1).unsqueeze(0), ks, vs, is_causal=True)
            if p.prefix_range is None and p.prefix_slots is None:
                out[rows] = diag.squeeze(0).transpose(0, 1)
                continue
            if p.prefix_range is not None:
                a, b = p.prefix_range
                kp, vp = k_flat[a:b], v_flat[a:b]
            else:
                kp = k_flat.index_select(0, p.prefix_slots)
                vp = v_flat.index_select(0, p.prefix_slots)
            # [1, Hkv, G * L, D]: a group's query heads stacked as rows, heads h = kv * G + g
            qg = qs.reshape(s.q_len, num_kv_heads, groups * head_dim)
            qg = qg.view(s.q_len, num_kv_heads, groups, head_dim).permute(1, 2, 0, 3)
            qg = qg.reshape(1, num_kv_heads, groups * s.q_len, head_dim)
            if self._amx and amx.usable(qg, kp):
                pre, lse_pre = amx.attention_prefix(qg[0], kp, vp)
            else:
                pre, lse_pre = self._op(
                    qg, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
                )
            pre = pre.reshape(num_heads, s.q_len, head_dim)
            lse_pre = lse_pre.reshape(num_heads, s.q_len)
            merged = merge(pre, lse_pre, diag.squeeze(0), lse_diag.squeeze(0))
            out[rows] = merged.transpose(0, 1)

    def _decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        k_flat: torch.Tensor,
        v_flat: torch.Tensor,
        meta: SplitMetadata,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """The step's decodes: the in-place kernel, else gathered groups through SDPA."""
        num_heads = q.shape[1]
        num_kv_heads, head_dim = k_flat.shape[1], k_flat.shape[2]
        groups = num_heads // num_kv_heads
        paged = meta.paged
        if paged is not None and paged_decode.usable(q, k_cache):
            paged_decode.paged_decode(
                q, k_flat, v_flat, paged.rows, paged.table, paged.ctx_lens, meta.block_size, out
            )
            return out
        if paged is not None and not meta.decode_groups:  # a layer the kernel cannot serve
            meta.decode_groups = decode_groups(paged.seqs, meta.block_table, meta.block_size)
        for g in meta.decode_groups:
            b = g.rows.numel()
            qd = q.index_select(0, g.rows).view(b, num_kv_heads, groups, head_dim)
            shape = (*g.kv_slots.shape, num_kv_heads, head_dim)
            flat = g.kv_slots.reshape(-1)
            kd = k_flat.index_select(0, flat).view(shape).transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_flat.index_select(0, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask)
            out.index_copy_(0, g.rows, o.reshape(b, num_heads, head_dim))
        return out
