"""A step holding several prefill chunks (and a decode) computes what each chunk computes in a
step of its own: the logits of the chunks that sample and every K/V row the step writes, for
head dims 64 and 128 (GQA 4), fp32 and bf16, at one and two torch threads, with the kernels
this CPU runs (``benchmarks/multichunk.py`` times the same layouts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledChunk, StepPlan
from engine.model.arch import BYTE_VOCAB, ModelArch
from engine.model.attention.select import select_backend
from engine.model.loader import ModelSource, load_model
from engine.model.runner import ModelRunner

CPU = torch.device("cpu")
BLOCK = 16
# (prompt length, tokens already computed, chunk tokens, kind): chunks of three prompts at
# different positions, one that samples nothing, and a decode
LAYOUT = [
    (200, 130, 70, "prefill"),
    (90, 0, 90, "prefill"),
    (300, 160, 48, "prefill"),
    (41, 40, 1, "decode"),
]


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def _runner(head_dim: int, dtype: torch.dtype) -> ModelRunner:
    arch = ModelArch(
        vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim,
    )  # fmt: skip
    loaded = load_model(ModelSource("test", arch, None), device=CPU, dtype=dtype,
                        max_positions=1024, seed=3)  # fmt: skip
    runner = ModelRunner(
        loaded.model, num_blocks=128, block_size=BLOCK, device=CPU, dtype=dtype,
        backend=select_backend("auto", CPU, BLOCK),
    )  # fmt: skip
    runner.keep_logits = True
    return runner


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(0)
    reqs, block = [], 1  # block 0 left unused: a wrong block id reads zeros
    for i, (length, _, _, _) in enumerate(LAYOUT):
        ids = torch.randint(0, 256, (length,), generator=g).tolist()
        req = Request(f"r{i}", ids, SamplingParams(max_tokens=4, temperature=0.0), arrival_ns=0)
        blocks = -(-length // BLOCK)
        req.block_ids = list(range(block + blocks - 1, block - 1, -1))  # not in order
        block += blocks
        reqs.append(req)
    return reqs


def _plan(chunks: list[ScheduledChunk]) -> StepPlan:
    return StepPlan(step=0, token_budget=4096, policy="chunked", chunks=chunks)


def _kv_rows(runner: ModelRunner, reqs: list[Request]) -> list[torch.Tensor]:
    """Every layer's K and V rows of each request's chunk, in position order."""
    out = []
    for req, (_, done, n, _) in zip(reqs, LAYOUT, strict=True):
        slots = torch.tensor([req.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                              for p in range(done, done + n)])  # fmt: skip
        for k, v in runner.kv_caches:
            out.append(k.flatten(0, 1)[slots].float())
            out.append(v.flatten(0, 1)[slots].float())
    return out


FP32, BF16 = torch.float32, torch.bfloat16
CASES = [
    (64, FP32, 1),
    (128, FP32, 1),
    (64, BF16, 1),
    (128, BF16, 1),
    (128, FP32, 2),
    (64, BF16, 2),
]


@pytest.mark.parametrize(
    ("head_dim", "dtype", "threads"),
    CASES,
    ids=[f"head {d}-{'fp32' if t == FP32 else 'bf16'}-{n} threads" for d, t, n in CASES],
    indirect=["threads"],
)
def test_chunks_together_equal_chunks_apart(
    head_dim: int, dtype: torch.dtype, threads: int
) -> None:
    runner = _runner(head_dim, dtype)
    reqs = _requests()
    for req, (_, done, _, _) in zip(reqs, LAYOUT, strict=True):  # the cached prefixes
        if done:
            runner.execute(_plan([ScheduledChunk(req, "prefill", 0, done)]))
    runner.kept_logits.clear()
    before = [t.clone() for pair in runner.kv_caches for t in pair]
    chunks = [ScheduledChunk(req, kind, done, n)
              for req, (_, done, n, kind) in zip(reqs, LAYOUT, strict=True)]  # fmt: skip
    together = runner.execute(_plan(chunks))
    logits_together = {k: v[-1] for k, v in runner.kept_logits.items()}
    kv_together = _kv_rows(runner, reqs)
    for t, saved in zip((t for pair in runner.kv_caches for t in pair), before, strict=True):
        t.copy_(saved)
    runner.kept_logits.clear()
    apart: dict[str, int] = {}
    for c in chunks:
        apart.update(runner.execute(_plan([c])))
    logits_apart = {k: v[-1] for k, v in runner.kept_logits.items()}
    assert set(together) == set(apart) == {"r0", "r1", "r3"}  # r2's chunk samples nothing
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for rid, row in logits_apart.items():
        torch.testing.assert_close(logits_together[rid], row, atol=tol, rtol=0)
    for a, b in zip(kv_together, _kv_rows(runner, reqs), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    if dtype == torch.float32:
        assert together == apart  # greedy: the same tokens
