"""A step's time at one and at two torch threads, the C kernels on against torch's own ops.

Two engines of the same model in one process: one as the engine builds it (the C kernels:
attention, fused row ops, fp32 panel linears), one with every kernel switched off (torch's
flash kernel and SDPA for attention, torch's row ops, MKL's linears: what ran before the
kernels shared their work out to threads, whenever the core had more than one; oneDNN's packed
bf16 weights are kept in both). Each runs two
hand-built steps, a prefill chunk of N tokens over a cached prefix and a decode step of B
sequences, at each thread count; all arms round-robin, medians of wall and CPU time, ratios to
the kernels' one-thread step.

-> results/threads_step.json

Run from the repo root:  .venv/bin/python -m benchmarks.threads_step [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from benchmarks._common import (
    add_common_args,
    config_of,
    contention_probe,
    setup,
    summarize,
    table,
    write_json,
)
from benchmarks.multichunk import _plan

OFF = {
    "CHUNKSCOPE_PANEL_LINEAR": "0",
    "CHUNKSCOPE_DECODE_KERNEL": "0",
    "CHUNKSCOPE_VEC_ATTENTION": "0",
    "CHUNKSCOPE_AMX_ATTENTION": "0",
}


def _decode_plan(runner, batch: int, ctx: int, rng: random.Random, first_block: int):  # type: ignore[no-untyped-def]
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.core.scheduler import ScheduledChunk, StepPlan

    chunks, block = [], first_block
    for i in range(batch):
        req = Request(f"d{i}", [rng.randrange(256) for _ in range(ctx)], SamplingParams(),
                      arrival_ns=0)  # fmt: skip
        blocks = -(-ctx // runner.block_size)
        req.block_ids = list(range(block, block + blocks))
        block += blocks
        chunks.append(ScheduledChunk(req, "decode", ctx - 1, 1))
    return StepPlan(step=0, token_budget=batch, policy="chunked", chunks=chunks), block


def _engine(args: argparse.Namespace, dtype: str, kernels: bool):  # type: ignore[no-untyped-def]
    import torch

    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model.attention import paged_decode, vec

    saved = {k: os.environ.get(k) for k in OFF}
    if not kernels:
        os.environ.update(OFF)
    try:
        torch.set_num_threads(1)
        engine = LLMEngine(
            EngineConfig(
                model=args.preset, dtype=dtype, device="cpu", enable_prefix_caching=False,
                max_model_len=args.prefix + args.tokens + 64, num_kv_blocks=args.kv_blocks,
                cpu_threads=1,
            )
        )  # fmt: skip
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        paged_decode.reset()
        vec.reset()
    return engine


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    import torch

    from engine.model import fused

    engines = {"kernels": _engine(args, dtype, True), "torch": _engine(args, dtype, False)}
    plans: dict[tuple[str, str], Any] = {}
    for name, engine in engines.items():
        rng = random.Random(1)
        runner = engine.runner
        plans[(name, "prefill")], block = _plan(runner, 1, args.tokens, args.prefix, rng, 0)
        plans[(name, "decode")], _ = _decode_plan(runner, args.batch, args.decode_ctx, rng, block)
    threads = [int(x) for x in args.threads_list.split(",")]
    arms = [(n, s, t) for n in engines for s in ("prefill", "decode") for t in threads]

    def run(arm: tuple[str, str, int]) -> tuple[float, float]:
        name, step, thr = arm
        torch.set_num_threads(thr)
        fused.set_enabled(name == "kernels")
        engines[name].runner.backend._decode_kernel = name == "kernels"  # type: ignore[attr-defined]
        c0, t0 = time.process_time(), time.perf_counter()
        engines[name].runner.execute(plans[(name, step)])
        return time.perf_counter() - t0, time.process_time() - c0

    for arm in arms:
        run(arm)
    reps = 2 if args.quick else args.reps
    wall: dict[Any, list[float]] = {a: [] for a in arms}
    cpu: dict[Any, list[float]] = {a: [] for a in arms}
    for _ in range(reps):
        for arm in arms:
            w, c = run(arm)
            wall[arm].append(w)
            cpu[arm].append(c)
    fused.set_enabled(True)
    torch.set_num_threads(1)
    rows = []
    for name, step, thr in arms:
        base = statistics.median(wall[("kernels", step, threads[0])])
        rows.append(
            {
                "ops": name,
                "step": step,
                "threads": thr,
                "step_time": summarize(wall[(name, step, thr)]),
                "step_cpu_time": summarize(cpu[(name, step, thr)]),
                "ratio_to_kernels_one_thread": statistics.median(wall[(name, step, thr)]) / base,
            }
        )
    return {"dtype": dtype, "reps": reps, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--tokens", type=int, default=512, help="the prefill chunk's tokens")
    ap.add_argument("--prefix", type=int, default=1024, help="its cached prefix")
    ap.add_argument("--batch", type=int, default=8, help="decodes in the decode step")
    ap.add_argument("--decode-ctx", type=int, default=600, help="each decode's context")
    ap.add_argument("--threads-list", default="1,2")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kv-blocks", type=int, default=1024)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.tokens, args.prefix, args.decode_ctx = 64, 128, 100
    res: dict[str, Any] = {
        "contention_before": contention_probe(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dtypes": [bench_dtype(args, d) for d in args.dtypes.split(",")],
    }
    res["contention_after"] = contention_probe()
    res["method"] = (
        "ModelRunner.execute of a hand-built prefill step (one chunk at a cached prefix) and a "
        "decode step (B sequences), on an engine with the C kernels and one with them off "
        "(panel linear, decode and AVX-512 kernels switched off, fused ops off; oneDNN's "
        "packed weights, a torch feature, kept in both), at each thread count; arms "
        "round-robin; wall and "
        "process CPU time per step."
    )
    write_json(out_dir / "threads_step.json", res, script="threads_step.py", config=config_of(args))
    for d in res["dtypes"]:
        print(f"\n== {d['dtype']}, {d['reps']} reps ==")
        print(
            table(
                [
                    [
                        r["ops"],
                        r["step"],
                        r["threads"],
                        r["step_time"]["median_ms"],
                        r["step_time"]["min_ms"],
                        r["step_cpu_time"]["median_ms"],
                        r["ratio_to_kernels_one_thread"],
                    ]  # fmt: skip
                    for r in d["rows"]
                ],
                ["ops", "step", "threads", "median ms", "min ms", "CPU ms", "x kernels 1 thread"],
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
