"""The packed per-step columns: a step's chunk layout and the tokens it produced.

``steps.chunks`` holds one 13-byte record per chunk, in scheduling order::

    req   int32   the request's number inside its run (requests.req_no)
    start int32   first position scheduled
    n     int32   number of tokens scheduled
    flags uint8   bit 0: decode (else prefill); bit 1: produced a token at the end of the step;
                  bit 2: the long-prefill cap kept this chunk smaller

``steps.tokens`` holds one 16-byte record per token the step produced (a chunk with the
produced bit), in the same order::

    req    int32  requests.req_no
    k      int32  the token's number in its request (1-based)
    itl_ns int64  end_ns of this step minus the time of token k-1; -1 for k = 1

All little-endian. Many steps unpack at once: join their bytes and ``np.frombuffer`` once.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

CHUNK_DTYPE = np.dtype([("req", "<i4"), ("start", "<i4"), ("n", "<i4"), ("flags", "u1")])
TOKEN_DTYPE = np.dtype([("req", "<i4"), ("k", "<i4"), ("itl_ns", "<i8")])
assert CHUNK_DTYPE.itemsize == 13 and TOKEN_DTYPE.itemsize == 16
FLAG_DECODE = 1
FLAG_PRODUCED = 2
FLAG_CAPPED = 4


_CHUNK = struct.Struct("<iiiB")  # CHUNK_DTYPE's record (no padding)
_TOKEN = struct.Struct("<iiq")  # TOKEN_DTYPE's record


def _pack(record: struct.Struct, rows: list[Any]) -> bytes:
    """The rows as records, in C (struct) per row: a few times cheaper than a numpy array of
    a step's few dozen rows. OverflowError for a value out of its field's range."""
    pack = record.pack
    try:
        return b"".join([pack(*row) for row in rows])
    except struct.error as exc:
        raise OverflowError(f"a packed field is out of range: {exc}") from None


def pack_chunks(rows: list[tuple[int, int, int, int]]) -> bytes:
    """``rows`` of (req_no, start, num_tokens, flags) as the packed column."""
    return _pack(_CHUNK, rows)


def pack_tokens(rows: list[tuple[int, int, int]]) -> bytes:
    """``rows`` of (req_no, k, itl_ns) as the packed column."""
    return _pack(_TOKEN, rows)


def unpack_chunks(blobs: list[bytes]) -> np.ndarray:
    """The chunk records of many steps, concatenated (a structured array of CHUNK_DTYPE)."""
    return np.frombuffer(b"".join(blobs), dtype=CHUNK_DTYPE)


def unpack_tokens(blobs: list[bytes]) -> np.ndarray:
    """The token records of many steps, concatenated (a structured array of TOKEN_DTYPE)."""
    return np.frombuffer(b"".join(blobs), dtype=TOKEN_DTYPE)
