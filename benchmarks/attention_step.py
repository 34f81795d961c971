"""The 512-token chunk step against the context length: attention backends and dtypes side by
side, beside the attention FLOP bound at the GEMM rate measured in the same run.

The issue-20 workload in-process, one torch thread (the engine core's default ``--cpu-threads``):
a local random-weight Llama folder (``build_llama_folder``: hidden 256, 4 layers, 4 query / 2
K/V heads, head_dim 64), budget 512, six chat streams of 200-token prompts decoding, then a
6,000-token prompt arrives and is prefilled in chunks of 506 tokens (512 minus the six decodes)
at contexts 506 .. 6,000. Per step: the step time (``StepEvent`` start to end), the time spent
inside the attention backend's ``forward`` (all layers), and the bounds: the step's attention
FLOPs (QK^T and PV of every query against the keys it sees, all layers) and its linear FLOPs
(2 x non-embedding parameters x tokens, plus the sampled rows' lm_head) over the GEMM rate of
the step's dtype, timed here (the faster of torch's matmul and oneDNN's packed-weight product
where the engine uses it: ``gemm_rate``). Then 12 decode-only steps of the six streams.

Arms: (sdpa, split) x (float32, bfloat16) by default, or any of sdpa, split, split-noamx (the
AMX kernel off), split-prefix (the AMX kernel on the prefix call only, as before issue 20d),
split-nofused (torch's row ops instead of engine/model/fused.py's), split-nopanel (torch's fp32
linear instead of engine/model/panel_linear.py's), split-novec (torch's flash kernel for the
chunks instead of engine/model/attention/vec.py's), split-nopacked (CHUNKSCOPE_PACKED_LINEAR=0:
torch's linear instead of engine/model/packed_linear.py's oneDNN-packed weights, bf16 and, on
non-Intel AVX-512 CPUs, fp32), engines built up front;
each repetition runs the whole workload once per arm, arms in a rotating order, so other
processes' noise hits every arm. GEMM rates are timed before and after the arms (best of
both).  -> results/attention_step.json (or --output)

    flock /work/notes/bench.lock .venv/bin/python -m benchmarks.attention_step [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_common_args, config_of, contention_probe, setup, write_json

CHAT_STREAMS = 6
CHAT_PROMPT = 200


class TimedBackend:
    """Delegates to an attention backend and adds up the seconds its ``forward`` takes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.seconds = 0.0

    def prepare_metadata(self, seqs, block_size, device):  # type: ignore[no-untyped-def]
        return self.inner.prepare_metadata(seqs, block_size, device)

    def forward(self, *args):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = self.inner.forward(*args)
        self.seconds += time.perf_counter() - t0
        return out


def gemm_rate(dtype: Any, n: int, reps: int) -> float:
    """FLOP/s of an n x n x n product in ``dtype``: the faster of torch's matmul and, where the
    engine packs this dtype's weights for oneDNN (``packed_linear``), oneDNN's product with a
    packed weight (on AMD CPUs MKL's fp32 ``matmul`` runs its AVX2 code, oneDNN AVX-512: the
    bound is the machine's rate, not one library's). Best of ``reps`` after a warm-up."""
    import torch

    from engine.model import packed_linear

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    products = [lambda: a @ b]
    if packed_linear.why_not(dtype, torch.device("cpu")) is None:
        w = torch.ops.mkldnn._reorder_linear_weight(b, packed_linear.BATCH_HINT)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        best = min(best, *(_timed(product) for _ in range(reps)))
    return 2 * n**3 / best


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def attention_flops(arch: Any, chunks: list[tuple[int, int]]) -> float:
    """QK^T and PV FLOPs of chunks (start, num_tokens), causal, all layers."""
    per_pair = 4 * arch.num_attention_heads * arch.head_dim * arch.num_hidden_layers
    pairs = sum(n * start + n * (n + 1) / 2 for start, n in chunks)
    return per_pair * pairs


def linear_flops(arch: Any, tokens: int, sampled: int) -> float:
    embed = arch.vocab_size * arch.hidden_size
    body = arch.num_params - embed * (1 if arch.tie_word_embeddings else 2)
    return 2 * body * tokens + 2 * embed * sampled


def build_engine(folder: Path, backend: str, dtype: str, max_len: int):  # type: ignore[no-untyped-def]
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    if backend == "split-nofused":  # split with torch's row ops (fused off while it runs)
        return build_engine(folder, "split", dtype, max_len)
    if backend == "split-prefix":  # the AMX kernel on the prefix call only (before issue 20d)
        engine = build_engine(folder, "split", dtype, max_len)
        engine.runner.backend.inner.amx_paged = False
        engine.runner.backend.inner._vec = False  # nor the AVX-512 whole-step kernel
        return engine
    switched_off = {  # the split backend with one of our kernels switched off at load
        "split-noamx": "CHUNKSCOPE_AMX_ATTENTION",  # the AMX attention kernel
        "split-nopanel": "CHUNKSCOPE_PANEL_LINEAR",  # fp32 panel linears (torch's linear)
        "split-novec": "CHUNKSCOPE_VEC_ATTENTION",  # the AVX-512 chunk attention kernel
        "split-nopacked": "CHUNKSCOPE_PACKED_LINEAR",  # oneDNN-packed weights (torch's linear)
    }
    if backend in switched_off:
        var = switched_off[backend]
        saved = os.environ.get(var)
        os.environ[var] = "0"
        try:
            engine = build_engine(folder, "split", dtype, max_len)
        finally:
            if saved is None:
                del os.environ[var]
            else:
                os.environ[var] = saved
        return engine
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            token_budget=512,
            max_model_len=max_len,
            num_kv_blocks=-(-4 * max_len // 16),
            enable_prefix_caching=False,
            device="cpu",
            dtype=dtype,
            attention_backend=backend,
            cpu_threads=1,
        )
    )
    assert engine.runner.backend.name == backend
    engine.runner.backend = TimedBackend(engine.runner.backend)
    return engine


def run_once(engine, rng: random.Random, prompt_len: int, decode_steps: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Six decoding streams, then the long prompt (max_tokens 1) prefilled beside them, then
    decode-only steps. Returns per-step rows of the prompt's chunks and the decode steps."""
    from engine.core.sampling_params import SamplingParams

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, 256) for _ in range(n)]

    chat = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for _ in range(CHAT_STREAMS):
        engine.add_request(prompt(CHAT_PROMPT), chat)
    while True:  # until all six decode
        ev = engine.step().event
        if ev is not None and ev.num_prefill_tokens == 0:
            break
    long_id = engine.add_request(prompt(prompt_len), SamplingParams(max_tokens=1))
    arch = engine.arch
    timed: TimedBackend = engine.runner.backend
    chunks: list[dict[str, Any]] = []
    decodes: list[dict[str, Any]] = []
    long_done = False
    while len(decodes) < decode_steps:
        timed.seconds = 0.0
        res = engine.step()
        ev = res.event
        assert ev is not None
        mine = [c for c in ev.chunks if c.request_id == long_id]
        row = {
            "step_ms": ev.duration * 1e3,
            "forward_ms": ev.forward_ns / 1e6,
            "attention_ms": timed.seconds * 1e3,
            "num_decode_tokens": ev.num_decode_tokens,
            "attention_flops": attention_flops(arch, [(c.start, c.num_tokens) for c in ev.chunks]),
            "linear_flops": linear_flops(
                arch, ev.num_scheduled_tokens, sum(c.produced_token for c in ev.chunks)
            ),
        }
        if mine:
            (c,) = mine
            row.update(
                chunk_start=c.start, chunk_tokens=c.num_tokens, context=c.start + c.num_tokens
            )
            chunks.append(row)
            long_done = c.produced_token
        elif long_done:
            decodes.append(row)
    for rid in list(engine._requests):  # noqa: SLF001 - benchmark bookkeeping only
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"chunks": chunks, "decodes": decodes}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.model import fused
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    torch.set_num_threads(1)
    arms = [(b, d) for d in args.dtypes for b in args.backends]
    rates_before = {d: gemm_rate(getattr(torch, d), args.gemm_n, 3) for d in args.dtypes}
    out: dict[str, Any] = {"contention_before": contention_probe()}
    with tempfile.TemporaryDirectory(prefix="attention-step-") as tmp:
        folder = build_llama_folder(
            Path(tmp) / "model", hidden_size=256, num_layers=4, max_positions=8192
        )
        engines = {arm: build_engine(folder, *arm, max_len=8192) for arm in arms}
        arch = next(iter(engines.values())).arch
        rng = random.Random(0)
        for arm in arms:  # warm-up: every shape once
            fused.set_enabled(arm[0] != "split-nofused")
            run_once(engines[arm], rng, args.prompt_len, 2)
        fused.set_enabled(True)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {arm: [] for arm in arms}
        for rep in range(args.reps):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]
            for arm in order:
                fused.set_enabled(arm[0] != "split-nofused")
                runs[arm].append(run_once(engines[arm], rng, args.prompt_len, args.decode_steps))
                fused.set_enabled(True)
                print(f"  rep {rep} {arm}: done, load {os.getloadavg()[0]:.2f}", flush=True)
        del engines
    rates_after = {d: gemm_rate(getattr(torch, d), args.gemm_n, 3) for d in args.dtypes}
    rates = {d: max(rates_before[d], rates_after[d]) for d in args.dtypes}
    per_arm: dict[str, Any] = {}
    for (backend, dtype), reps in runs.items():  # split-noamx / split-prefix: split variants
        rate = rates[dtype]
        steps = []
        for i, first in enumerate(reps[0]["chunks"]):
            rows = [r["chunks"][i] for r in reps]
            step = statistics.median(r["step_ms"] for r in rows)
            attn = statistics.median(r["attention_ms"] for r in rows)
            steps.append(
                {
                    "context": first["context"],
                    "chunk_start": first["chunk_start"],
                    "chunk_tokens": first["chunk_tokens"],
                    "num_decode_tokens": first["num_decode_tokens"],
                    "step_ms": step,
                    "step_ms_min": min(r["step_ms"] for r in rows),
                    "forward_ms": statistics.median(r["forward_ms"] for r in rows),
                    "attention_ms": attn,
                    "attention_share": attn / step,
                    "attention_bound_ms": first["attention_flops"] / rate * 1e3,
                    "attention_gflops": first["attention_flops"] / attn / 1e6,
                    "step_bound_ms": (first["attention_flops"] + first["linear_flops"])
                    / rate
                    * 1e3,
                }
            )
        dec = [r for rep in reps for r in rep["decodes"]]
        per_arm[f"{backend}/{dtype}"] = {
            "backend": backend,
            "dtype": dtype,
            "gemm_gflops": rate / 1e9,
            "chunk_steps": steps,
            "prompt_prefill_ms": statistics.median(
                sum(r["step_ms"] for r in rep["chunks"]) for rep in reps
            ),
            "decode_only_step_ms": statistics.median(r["step_ms"] for r in dec),
            "decode_only_attention_ms": statistics.median(r["attention_ms"] for r in dec),
        }
    ratios: dict[str, Any] = {}
    for dtype in args.dtypes:
        for base, label in (
            ("split-noamx", "without AMX kernel"),
            ("split-prefix", "prefix-only"),
            ("split-nofused", "without fused row ops"),
            ("split-nopanel", "without panel linears"),
            ("split-novec", "without the AVX-512 chunk kernel"),
            ("split-nopacked", "without oneDNN-packed linears"),
        ):
            off, on = per_arm.get(f"{base}/{dtype}"), per_arm.get(f"split/{dtype}")
            if not (off and on):
                continue
            ratios[f"{dtype}: split {label} over split"] = {
                "prompt_prefill": off["prompt_prefill_ms"] / on["prompt_prefill_ms"],
                "last_chunk_step": off["chunk_steps"][-1]["step_ms"]
                / on["chunk_steps"][-1]["step_ms"],
                "last_chunk_attention": off["chunk_steps"][-1]["attention_ms"]
                / on["chunk_steps"][-1]["attention_ms"],
                "decode_only_step": off["decode_only_step_ms"] / on["decode_only_step_ms"],
            }
    for dtype in args.dtypes:
        old, new = per_arm.get(f"sdpa/{dtype}"), per_arm.get(f"split/{dtype}")
        if old and new:
            ratios[dtype] = {
                "prompt_prefill_old_over_new": old["prompt_prefill_ms"] / new["prompt_prefill_ms"],
                "last_chunk_step_old_over_new": old["chunk_steps"][-1]["step_ms"]
                / new["chunk_steps"][-1]["step_ms"],
                "decode_only_step_old_over_new": old["decode_only_step_ms"]
                / new["decode_only_step_ms"],
            }
    if "float32" in args.dtypes and "bfloat16" in args.dtypes:
        for backend in args.backends:
            ratios[f"{backend}: float32 over bfloat16 prompt prefill"] = (
                per_arm[f"{backend}/float32"]["prompt_prefill_ms"]
                / per_arm[f"{backend}/bfloat16"]["prompt_prefill_ms"]
            )
    out.update(
        {
            "model": {
                "folder": "build_llama_folder(hidden_size=256, num_layers=4)",
                "arch": arch.to_dict(),
                "num_params": arch.num_params,
            },
            "workload": {
                "token_budget": 512,
                "chat_streams": CHAT_STREAMS,
                "chat_prompt_tokens": CHAT_PROMPT,
                "prompt_tokens": args.prompt_len,
                "decode_only_steps": args.decode_steps,
                "torch_threads": 1,
                "reps": args.reps,
                "order": "arms rotated per repetition; medians over repetitions",
            },
            "gemm": {
                "n": args.gemm_n,
                "gflops_before": {d: r / 1e9 for d, r in rates_before.items()},
                "gflops_after": {d: r / 1e9 for d, r in rates_after.items()},
                "used": "best of before and after, per dtype",
            },
            "per_arm": per_arm,
            "ratios": ratios,
            "contention_after": contention_probe(),
        }
    )
    return out


def print_result(res: dict[str, Any]) -> None:
    arms = list(res["per_arm"].values())
    print(
        "\ncontext | " + " | ".join(f"{a['backend']}/{a['dtype']} step (attn, bound)" for a in arms)
    )
    for i, s in enumerate(arms[0]["chunk_steps"]):
        cells = [
            f"{a['chunk_steps'][i]['step_ms']:.1f} ({a['chunk_steps'][i]['attention_ms']:.1f}, "
            f"{a['chunk_steps'][i]['attention_bound_ms']:.1f})"
            for a in arms
        ]
        print(f"{s['context']:6d} | " + " | ".join(cells))
    for a in arms:
        print(
            f"{a['backend']}/{a['dtype']}: prompt {a['prompt_prefill_ms']:.0f} ms, "
            f"decode-only step {a['decode_only_step_ms']:.2f} ms "
            f"(attention {a['decode_only_attention_ms']:.2f}), "
            f"GEMM {a['gemm_gflops']:.0f} GFLOP/s"
        )
    print(res["ratios"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument(
        "--backends",
        default="sdpa,split",
        help="of sdpa, split, split-noamx (split with CHUNKSCOPE_AMX_ATTENTION=0), "
        "split-prefix (the AMX kernel on the prefix call only), split-nofused (torch's row ops "
        "instead of engine/model/fused.py's), split-nopanel (torch's fp32 linear instead of "
        "engine/model/panel_linear.py's), split-novec (torch's flash kernel for the chunks "
        "instead of engine/model/attention/vec.py's), split-nopacked (CHUNKSCOPE_PACKED_LINEAR=0: "
        "torch's linear instead of engine/model/packed_linear.py's oneDNN-packed weights)",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompt-len", type=int, default=6000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--gemm-n", type=int, default=2048)
    ap.add_argument("--output", default="attention_step.json", help="file in the results folder")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt_len, args.reps, args.decode_steps, args.gemm_n = 1200, 1, 3, 256
    out_dir = setup(args)
    args.backends = [b for b in args.backends.split(",") if b]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    t0 = time.perf_counter()
    res = bench(args)
    write_json(out_dir / args.output, res, script="attention_step.py", config=config_of(args))
    print_result(res)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
