"""SDPA backend: the fused-kernel form of an offset chunk's causal mask (``causal_lower_right``,
the CUDA default) computes what the dense boolean mask (the CPU default) computes, and both
equal attention written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.attention.common import SeqSlice
from engine.model.attention.sdpa import SdpaBackend
from tests.engine.model.test_attention_flex import (
    CASES,
    Case,
    _forward,
    _inputs,
    _layout,
    _num_blocks,
)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lower_right_bias_equals_dense_mask(case: Case) -> None:
    nb = _num_blocks(case)
    seqs = _layout(case, nb)
    cache, qkv = _inputs(case, seqs, nb)
    dense = _forward(SdpaBackend(lower_right=False), case, seqs, cache, qkv)
    fused = _forward(SdpaBackend(lower_right=True), case, seqs, cache, qkv)
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=0)


def _by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [L, Hq, D] at positions start.., k/v [S, Hkv, D] at positions 0..S-1."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("lower_right", [False, True])
def test_offset_chunk_equals_attention_by_hand(lower_right: bool) -> None:
    case = Case("offset", [(50, 130, "a")])
    nb = _num_blocks(case)
    seqs = _layout(case, nb)
    cache, (q, k, v) = _inputs(case, seqs, nb)
    got = _forward(SdpaBackend(lower_right=lower_right), case, seqs, cache, (q, k, v))
    s: SeqSlice = seqs[0]
    bs = case.block_size
    slots = torch.tensor([b * bs + i for b in s.block_ids for i in range(bs)])[: s.ctx_len]
    start = s.ctx_len - s.q_len
    k_ctx = cache[0].reshape(-1, *cache[0].shape[2:])[slots].clone()
    v_ctx = cache[1].reshape(-1, *cache[1].shape[2:])[slots].clone()
    k_ctx[start:], v_ctx[start:] = k, v  # the step's own K/V land in the cache first
    torch.testing.assert_close(got, _by_hand(q, k_ctx, v_ctx, start), atol=1e-5, rtol=0)
