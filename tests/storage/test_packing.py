"""The packed per-step columns read back exactly what was packed, many steps at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from storage.packing import pack_chunks, pack_tokens, unpack_chunks, unpack_tokens

i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
chunk = st.tuples(i32, i32, i32, st.integers(min_value=0, max_value=3))
token = st.tuples(i32, i32, st.integers(min_value=-(2**63), max_value=2**63 - 1))


@given(st.lists(st.lists(chunk, max_size=20), max_size=10))
def test_chunks_round_trip(steps: list[list[tuple[int, int, int, int]]]) -> None:
    blobs = [pack_chunks(rows) for rows in steps]
    assert all(len(b) == 13 * len(rows) for b, rows in zip(blobs, steps, strict=True))
    got = unpack_chunks(blobs)
    assert [tuple(int(x) for x in r) for r in got] == [r for rows in steps for r in rows]


@given(st.lists(st.lists(token, max_size=20), max_size=10))
def test_tokens_round_trip(steps: list[list[tuple[int, int, int]]]) -> None:
    blobs = [pack_tokens(rows) for rows in steps]
    got = unpack_tokens(blobs)
    assert [tuple(int(x) for x in r) for r in got] == [r for rows in steps for r in rows]


def test_memoryview_blobs_from_postgres_unpack() -> None:
    rows = [(1, 2, 3, 3), (4, 5, 6, 0)]
    assert len(unpack_chunks([memoryview(pack_chunks(rows)), b""])) == 2
