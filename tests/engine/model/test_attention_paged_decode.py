"""Decode attention read in place from the paged cache (``paged_decode``): equal to SDPA over the
gathered context (fp32 to 1e-5, bf16 within bf16's own noise) on the paged layouts the split
tests build (head dims 32, 64 and 128, GQA 1 to 8), in the split backend and at engine level;
at two torch threads the same bits as at one; the torch path wherever it cannot run."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from engine.model.attention import paged_decode
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.split import SplitBackend
from tests.engine.model.test_attention_split import (
    ATOL,
    CPU,
    Case,
    _engine_run,
    _forward,
    _setup,
)

needs_kernel = pytest.mark.skipif(
    paged_decode.decode_kernel() is None, reason="the decode kernel cannot be built here"
)

CASES = [
    Case("decodes only, GQA 2", [(1, 1, "a"), (1, 17, "b"), (1, 250, "c"), (1, 700, "d")]),
    Case("decodes beside a chunk", [(64, 300, "a"), (1, 33, "b"), (1, 260, "c")]),
    Case("head dim 64, GQA 4", [(1, 129, "a"), (1, 5, "b")], head_dim=64, heads=(8, 2)),
    Case("head dim 128, no GQA", [(1, 77, "a"), (1, 300, "b")], head_dim=128, heads=(2, 2)),
    Case("head dim 128, GQA 4", [(1, 260, "a"), (1, 9, "b")], head_dim=128, heads=(8, 2)),
    Case(
        "head dim 128, GQA 8",
        [(1, 90, "a"), (1, 400, "b"), (1, 3, "c")],
        head_dim=128,
        heads=(8, 1),
    ),  # fmt: skip
    Case("block size 7, shared prefix", [(1, 40, "p"), (1, 41, "p"), (1, 3, "x")], 7),
    Case("one block size 1 run", [(1, 31, "a"), (1, 2, "b")], 1, consecutive=True),
]


@pytest.fixture(autouse=True)
def no_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPUs with AMX a bf16 step goes whole to the AMX kernel, and on other AVX-512 CPUs to
    the AVX-512 one; these tests are of the path that runs elsewhere (no AVX-512)."""
    monkeypatch.setenv("CHUNKSCOPE_AMX_ATTENTION", "0")
    monkeypatch.setenv("CHUNKSCOPE_VEC_ATTENTION", "0")


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many decodes each kernel call served (the kernel must have run, not the fallback)."""
    seen: list[int] = []
    real = paged_decode.paged_decode

    def counting(q, k, v, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(rows.numel())
        return real(q, k, v, rows, *args, **kwargs)

    monkeypatch.setattr(paged_decode, "paged_decode", counting)
    return seen


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_equals_sdpa_fp32(case: Case, calls: list[int]) -> None:
    seqs, cache, qkv = _setup(case)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    got = _forward(SplitBackend(), case, seqs, cache, qkv)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert calls == [sum(s.q_len == 1 for s in seqs)] * 2  # both layers, every decode


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_bf16_within_bf16_noise(case: Case, calls: list[int]) -> None:
    seqs, cache, qkv = _setup(case)
    ref32 = _forward(SdpaBackend(), case, seqs, cache, qkv)
    ref16 = _forward(SdpaBackend(), case, seqs, cache, qkv, torch.bfloat16)
    got = _forward(SplitBackend(), case, seqs, cache, qkv, torch.bfloat16)
    decode = torch.zeros(ref32.shape[0], dtype=torch.bool)
    for s in seqs:
        decode[s.q_start] = s.q_len == 1
    noise = (ref16 - ref32)[decode].abs()
    err = (got - ref32)[decode].abs()
    # the split tests' rule: on few values one ulp more than the reference's at the max, and
    # on average no worse than bf16's own noise (measured: 0.93-0.99x of it on these cases)
    assert float(err.max()) <= 2 * float(noise.max())
    assert float(err.mean()) <= 1.05 * float(noise.mean())
    assert calls


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("bug", ["one key short", "wrong block", "K/V heads swapped"])
def test_planted_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[0]
    seqs, cache, qkv = _setup(case)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    real = paged_decode.paged_decode

    def broken(q, k, v, rows, table, lens, *args, **kwargs):  # type: ignore[no-untyped-def]
        if bug == "one key short":
            lens = (lens - 1).clamp_min(1)
        elif bug == "wrong block":
            table = table.roll(1, dims=1).contiguous()
        else:
            k, v = k.flip(1), v.flip(1)
        return real(q, k, v, rows, table, lens, *args, **kwargs)

    monkeypatch.setattr(paged_decode, "paged_decode", broken)
    got = _forward(SplitBackend(), case, seqs, cache, qkv)
    assert (got - ref).abs().max() > 1e-3


@pytest.mark.parametrize("why", ["switched off", "no compiler", "two threads, no OpenMP"])
def test_the_torch_path_runs_where_the_kernel_cannot(
    why: str, monkeypatch: pytest.MonkeyPatch, calls: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    case = CASES[1]
    seqs, cache, qkv = _setup(case)
    ref = _forward(SdpaBackend(), case, seqs, cache, qkv)
    before = torch.get_num_threads()
    paged_decode.reset()
    try:
        if why == "switched off":
            monkeypatch.setenv("CHUNKSCOPE_DECODE_KERNEL", "0")
        elif why == "no compiler":
            monkeypatch.setenv("CC", "/nonexistent/cc")
            monkeypatch.setenv("CHUNKSCOPE_KERNEL_CACHE", "/tmp/chunkscope-test-no-cc-cache")
        else:  # built as a compiler without OpenMP builds it: one thread only
            monkeypatch.setattr(paged_decode.ckernel, "build_threaded", paged_decode.ckernel.build)
        torch.set_num_threads(2 if why.startswith("two threads") else 1)
        with caplog.at_level(logging.INFO, logger=paged_decode.__name__):
            got = _forward(SplitBackend(), case, seqs, cache, qkv)
    finally:
        torch.set_num_threads(before)
        paged_decode.reset()
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert calls == []
    if why == "no compiler":
        assert "paged decode attention kernel not used" in caplog.text


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_two_threads_give_one_threads_bits(
    case: Case, dtype: torch.dtype, calls: list[int]
) -> None:
    """Each (sequence, K/V head) pair is computed alike whichever thread takes it."""
    seqs, cache, qkv = _setup(case)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _forward(SplitBackend(), case, seqs, cache, qkv, dtype)
        n = len(calls)
        torch.set_num_threads(2)
        two = _forward(SplitBackend(), case, seqs, cache, qkv, dtype)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 * n > 0  # the kernel ran at two threads too
    decode = torch.tensor([s.q_start for s in seqs if s.q_len == 1])
    assert torch.equal(one[decode], two[decode])


@needs_kernel
def test_bad_tensors_are_refused_before_the_kernel_runs() -> None:
    q = torch.randn(3, 4, 32)
    cache = torch.randn(64, 2, 32)
    rows = torch.tensor([0, 2])
    table = torch.zeros(2, 4, dtype=torch.long)
    lens = torch.tensor([5, 9])
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="int64"):
        paged_decode.paged_decode(q, cache, cache, rows.int(), table, lens, 16, out)
    with pytest.raises(ValueError, match="bad tensors"):
        paged_decode.paged_decode(q, cache.bfloat16(), cache, rows, table, lens, 16, out)
    with pytest.raises(ValueError, match="number of sequences"):
        paged_decode.paged_decode(q, cache, cache, rows, table[:1], lens, 16, out)


@needs_kernel
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tokens_unchanged_by_the_kernel(
    dtype: str, monkeypatch: pytest.MonkeyPatch, calls: list[int]
) -> None:
    with_kernel = _engine_run("split", dtype, 64)
    assert calls, "the kernel did not run"
    monkeypatch.setenv("CHUNKSCOPE_DECODE_KERNEL", "0")
    without = _engine_run("split", dtype, 64)
    for rid, (tokens, logits) in without.items():
        assert with_kernel[rid][0] == tokens
        tol = 1e-4 if dtype == "float32" else 0.1
        torch.testing.assert_close(with_kernel[rid][1], logits, atol=tol, rtol=0)
    assert CPU.type == "cpu"
