"""The packed chunk and token columns of many steps at once, with numpy: what
``Store._step`` does chunk by chunk, for one run's steps of one transaction whose chunks
``storage.frames`` decoded (their values are checked already: string ids, int32 fields).

Token times follow the store's rule (``storage.store``): a produced chunk gives its request
token ``k = previous k + 1`` at its step's ``end_ns``, ``itl_ns = end_ns - time of token k-1``
(-1 for a request's first token, or when the time of the previous one is unknown). Within the
steps given, a request's tokens are numbered in step order, so the result is the chunk-by-chunk
one: the produced chunks are sorted by request (stably), numbered within each request from its
count before these steps, and each one's gap is to the one before it in its request (the first
one's to the request's ``last_token_ns``). Requests are then updated once each.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from storage.packing import CHUNK_DTYPE, FLAG_CAPPED, FLAG_DECODE, FLAG_PRODUCED, TOKEN_DTYPE

if TYPE_CHECKING:
    from storage.frames import Chunk
    from storage.store import RequestState

_START = attrgetter("start")
_NUM_TOKENS = attrgetter("num_tokens")
_KIND = attrgetter("kind")
_PRODUCED = attrgetter("produced_token")
_CAPPED = attrgetter("capped")
_REQ_NO = attrgetter("req_no")
_IS_DECODE = "decode".__eq__
INT32_MAX = 2**31 - 1
GAP_PAST_INT64 = "a packed field is out of range: an inter-token gap past int64"


@dataclass
class PlainStep:
    """A step whose row is made but for its packed columns: its chunks and their requests."""

    event: dict[str, Any]
    row: dict[str, Any]
    chunks: list[Chunk]
    reqs: list[RequestState]
    step: int
    end_ns: int
    result: Any  # the store's EventsResult of the op it came in


def stamp(steps: list[PlainStep], dirty: dict[int, RequestState]) -> None:
    """Fill each step's row with ``chunks``, ``tokens``, ``num_chunks`` and ``num_tokens_out``,
    move the requests' token state past these steps, and note every request that produced a
    token in ``dirty`` (req_no -> request). OverflowError, before anything is changed, when a
    value would not fit its packed field (a request number or token number past int32, a gap
    past int64): the caller then takes the steps one by one, as ``Store._step`` does."""
    sizes = np.fromiter(map(len, map(attrgetter("chunks"), steps)), np.int64, len(steps))
    total = int(sizes.sum())
    chunks = list(chain.from_iterable(s.chunks for s in steps))
    reqs = list(chain.from_iterable(s.reqs for s in steps))
    produced = np.fromiter(map(_PRODUCED, chunks), np.bool_, total)
    req_no = np.fromiter(map(_REQ_NO, reqs), np.int64, total)
    if total and int(req_no.max()) > INT32_MAX:
        raise OverflowError(f"a packed field is out of range: req_no {int(req_no.max())}")
    rec = np.empty(total, CHUNK_DTYPE)
    rec["req"] = req_no
    rec["start"] = np.fromiter(map(_START, chunks), np.int32, total)
    rec["n"] = np.fromiter(map(_NUM_TOKENS, chunks), np.int32, total)
    flags = produced.astype(np.uint8) * FLAG_PRODUCED
    kinds = list(map(_KIND, chunks))
    decode = kinds.count("decode")  # all or none, most often: no array of them
    if decode == total:
        flags |= FLAG_DECODE
    elif decode:
        flags |= np.fromiter(map(_IS_DECODE, kinds), np.uint8, total) * FLAG_DECODE
    capped = list(map(_CAPPED, chunks))
    if capped.count(True):
        flags |= np.array(capped, np.uint8) * FLAG_CAPPED
    rec["flags"] = flags
    tok = _tokens(steps, sizes, produced, req_no, reqs, dirty)
    chunk_end = np.cumsum(sizes)
    made = np.concatenate(([0], np.cumsum(produced)))
    tok_end = made[chunk_end]
    c0 = t0 = 0
    for s, c1, t1 in zip(steps, chunk_end.tolist(), tok_end.tolist(), strict=True):
        row = s.row
        row["num_chunks"] = c1 - c0
        row["num_tokens_out"] = t1 - t0
        row["chunks"] = rec[c0:c1].tobytes()
        row["tokens"] = tok[t0:t1].tobytes()
        c0, t0 = c1, t1


def _tokens(
    steps: list[PlainStep],
    sizes: np.ndarray,
    produced: np.ndarray,
    req_no: np.ndarray,
    reqs: list[RequestState],
    dirty: dict[int, RequestState],
) -> np.ndarray:
    """The token records of the produced chunks, in chunk order; updates their requests."""
    where = np.flatnonzero(produced)
    n = len(where)
    tok = np.empty(n, TOKEN_DTYPE)
    if n == 0:
        return tok
    end_ns = np.repeat(np.array([s.end_ns for s in steps], np.int64), sizes)[where]
    step_no = np.repeat(np.arange(len(steps)), sizes)[where]
    r = req_no[where]
    order = np.argsort(r, kind="stable")
    rs, ends = r[order], end_ns[order]
    first = np.empty(n, np.bool_)
    first[0] = True
    np.not_equal(rs[1:], rs[:-1], out=first[1:])
    heads = np.flatnonzero(first)  # where each request's run of tokens starts (sorted order)
    group = np.cumsum(first) - 1
    owners = [reqs[i] for i in where[order[heads]].tolist()]
    base = np.array([q.num_tokens for q in owners], np.int64)
    last_known = np.array([q.last_token_ns is not None for q in owners], np.bool_)
    last = np.array([q.last_token_ns or 0 for q in owners], np.int64)
    k = base[group] + (np.arange(n) - heads[group]) + 1
    if int(k.max()) > INT32_MAX:
        raise OverflowError(f"a packed field is out of range: token number {int(k.max())}")
    prev = np.empty(n, np.int64)
    prev[1:] = ends[:-1]
    prev[heads] = last
    itl = ends - prev
    # a request's first token, or one after a token of unknown time: no gap
    fresh = np.zeros(n, np.bool_)
    fresh[heads] = (base == 0) | ~last_known
    itl[fresh] = -1
    # a gap past int64 (only around end_ns values of +-2**62 and beyond) wrapped around
    wrapped = ((ends ^ prev) & (ends ^ itl)) < 0
    if wrapped[~fresh].any():
        raise OverflowError(GAP_PAST_INT64)
    tails = np.append(heads[1:], n) - 1
    counts = tails - heads + 1
    # the largest gap of each request among its tokens that have one
    gaps = np.where(fresh, np.iinfo(np.int64).min, itl)
    top = np.maximum.reduceat(gaps, heads)
    # one request at a time from here: Python ints (a numpy scalar costs more to read)
    step_of = [s.step for s in steps]
    sorted_step = step_no[order]
    head_fresh = fresh[heads].tolist()
    head_end = ends[heads].tolist()
    head_step = sorted_step[heads].tolist()
    tail_k = k[tails].tolist()
    tail_end = ends[tails].tolist()
    tail_step = sorted_step[tails].tolist()
    gapped = ((counts > 1) | ~fresh[heads]).tolist()
    tops = top.tolist()
    for i, q in enumerate(owners):
        if head_fresh[i]:
            q.first_token_ns = head_end[i]
            q.first_token_step = step_of[head_step[i]]
        if gapped[i]:
            m = tops[i]
            if q.max_itl_ns is None or m > q.max_itl_ns:
                q.max_itl_ns = m
        q.num_tokens = tail_k[i]
        q.last_token_ns = tail_end[i]
        q.last_token_step = step_of[tail_step[i]]
        dirty[q.req_no] = q
    out_k = np.empty(n, np.int64)
    out_k[order] = k
    out_itl = np.empty(n, np.int64)
    out_itl[order] = itl
    tok["req"] = r
    tok["k"] = out_k
    tok["itl_ns"] = out_itl
    return tok
