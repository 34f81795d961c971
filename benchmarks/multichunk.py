"""A step of k prefill chunks against a step of one chunk of the same tokens, in process.

The model's runner executes hand-built step plans (no scheduler, no server): arm ``k`` is one
step holding k prefill chunks of N / k tokens, each of its own request, each at the same
position P (its prefix of P tokens already in the KV cache), so every arm computes N tokens
of linear work and about the same attention work (each query attends to P + its place in its
chunk keys; the attention pairs of each arm are recorded). Arms run round-robin (1, 2, 4, 8, 1,
2, ...) so that load from other processes falls on all of them alike; medians and each arm's
ratio to the one-chunk arm, per dtype, prefix and torch thread count; the same for the
process's CPU time of each step (``time.process_time``: at one thread, the step's work without
the time other processes held the core, the steadier figure on a shared machine). With
``--threads-list 1,2`` the thread counts alternate too (``torch.set_num_threads`` between
steps) and the ratio of each thread count's step to the one-thread step is reported as well.

-> results/multichunk.json

Run from the repo root:  .venv/bin/python -m benchmarks.multichunk [--quick]
"""

from __future__ import annotations

import argparse
import itertools
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


def _plan(runner, k: int, n: int, prefix: int, rng: random.Random, first_block: int):  # type: ignore[no-untyped-def]
    """A step plan of k prefill chunks of n // k tokens at position ``prefix`` (each request's
    blocks consecutive from ``first_block`` on), and the next free block."""
    from engine.core.request import Request
    from engine.core.sampling_params import SamplingParams
    from engine.core.scheduler import ScheduledChunk, StepPlan

    per = n // k
    chunks = []
    block = first_block
    for i in range(k):
        total = prefix + per + 1  # one token more: the chunk samples nothing (no logits)
        req = Request(
            f"k{k}-{i}",
            [rng.randrange(256) for _ in range(total)],
            SamplingParams(max_tokens=1),
            arrival_ns=0,
        )
        blocks = -(-total // runner.block_size)
        req.block_ids = list(range(block, block + blocks))
        block += blocks
        chunks.append(ScheduledChunk(req, "prefill", prefix, per))
    return StepPlan(step=0, token_budget=n, policy="chunked", chunks=chunks), block


def _pairs(k: int, n: int, prefix: int) -> int:
    """(query, key) pairs the arm's attention computes (causal within each chunk)."""
    per = n // k
    return k * (per * prefix + per * (per + 1) // 2)


def bench_dtype(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    import torch

    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    ks = [int(x) for x in args.chunks.split(",")]
    threads = [int(x) for x in args.threads_list.split(",")]
    prefixes = [int(x) for x in args.prefixes.split(",")]
    torch.set_num_threads(threads[0])
    engine = LLMEngine(
        EngineConfig(
            model=args.preset,
            dtype=dtype,
            device="cpu",
            max_model_len=max(prefixes) + args.tokens + 64,
            enable_prefix_caching=False,
            num_kv_blocks=args.kv_blocks,
            cpu_threads=threads[0],
        )
    )
    runner = engine.runner
    rng = random.Random(1)
    plans: dict[tuple[int, int], Any] = {}
    block = 0
    for prefix in prefixes:
        for k in ks:
            plans[(prefix, k)], block = _plan(runner, k, args.tokens, prefix, rng, block)
    if block > runner.kv_caches[0][0].shape[0]:
        raise SystemExit(f"--kv-blocks too small: the plans need {block} blocks")
    arms = list(itertools.product(prefixes, threads, ks))
    for prefix, thr, k in arms:  # warm-up: one untimed step of every arm
        torch.set_num_threads(thr)
        runner.execute(plans[(prefix, k)])
    reps = args.reps if dtype == "float32" else args.reps_bf16
    if args.quick:
        reps = 2
    times: dict[tuple[int, int, int], list[float]] = {a: [] for a in arms}
    cpu: dict[tuple[int, int, int], list[float]] = {a: [] for a in arms}
    for _ in range(reps):
        for arm in arms:
            prefix, thr, k = arm
            torch.set_num_threads(thr)
            c0, t0 = time.process_time(), time.perf_counter()
            runner.execute(plans[(prefix, k)])
            times[arm].append(time.perf_counter() - t0)
            cpu[arm].append(time.process_time() - c0)
    torch.set_num_threads(threads[0])
    rows = []
    for prefix, thr, k in arms:
        med = statistics.median(times[(prefix, thr, k)])
        one = statistics.median(times[(prefix, thr, ks[0])])
        one_thread = statistics.median(times[(prefix, threads[0], k)])
        cpu_med = statistics.median(cpu[(prefix, thr, k)])
        cpu_one = statistics.median(cpu[(prefix, thr, ks[0])])
        rows.append(
            {
                "prefix_tokens": prefix,
                "threads": thr,
                "chunks": k,
                "tokens": args.tokens,
                "chunk_tokens": args.tokens // k,
                "attention_pairs": _pairs(k, args.tokens, prefix),
                "step_time": summarize(times[(prefix, thr, k)]),
                "step_cpu_time": summarize(cpu[(prefix, thr, k)]),
                "ratio_to_one_chunk": med / one,
                "cpu_ratio_to_one_chunk": cpu_med / cpu_one,
                f"ratio_to_{threads[0]}_threads": med / one_thread,
            }
        )
    out = {
        "dtype": dtype,
        "attention_backend": runner.backend.name,
        "arch": engine.arch.to_dict(),
        "reps": reps,
        "rows": rows,
    }
    del engine, runner
    return out


def print_rows(res: dict[str, Any]) -> None:
    for d in res["dtypes"]:
        first = res["config"]["threads_list"].split(",")[0]
        print(f"\n== {d['dtype']}, {d['attention_backend']} backend, {d['reps']} reps ==")
        rows = [
            [
                r["prefix_tokens"],
                r["threads"],
                r["chunks"],
                r["step_time"]["median_ms"],
                r["step_time"]["min_ms"],
                r["ratio_to_one_chunk"],
                r["step_cpu_time"]["median_ms"],
                r["cpu_ratio_to_one_chunk"],
                r[f"ratio_to_{first}_threads"],
            ]
            for r in d["rows"]
        ]
        header = ["prefix", "threads", "chunks", "median ms", "min ms", "x 1 chunk", "CPU ms"]
        header.append("CPU x 1 chunk")
        print(table(rows, [*header, f"x {first} threads"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=512, help="prefill tokens of every step (N)")
    ap.add_argument("--chunks", default="1,2,4,8", help="chunk counts k (the first: the baseline)")
    ap.add_argument("--prefixes", default="0,2048", help="positions of the chunks (cached tokens)")
    ap.add_argument(
        "--threads-list", default="1", help="torch thread counts, alternated (first: baseline)"
    )
    ap.add_argument("--reps", type=int, default=15, help="steps per arm in fp32")
    ap.add_argument("--reps-bf16", type=int, default=5, help="steps per arm in bf16")
    ap.add_argument("--kv-blocks", type=int, default=4096)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.prefixes, args.tokens = "0,256", 128
    res: dict[str, Any] = {
        "contention_before": contention_probe(),
        # libgomp's default (unset: spin a while at each barrier) makes a thread wait on a
        # descheduled one when other processes hold the cores: record it beside the threads
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "dtypes": [],
    }
    for dtype in args.dtypes.split(","):
        res["dtypes"].append(bench_dtype(args, dtype))
    res["contention_after"] = contention_probe()
    res["method"] = (
        "ModelRunner.execute of hand-built plans: arm k = k requests, each one prefill chunk of "
        "N/k tokens at position P (its P-token prefix already cached, blocks consecutive), no "
        "sampling (each chunk stops one token short of its prompt's end); arms round-robin, "
        "one untimed warm-up step each; wall time of execute(), medians and ratios."
    )
    write_json(out_dir / "multichunk.json", res, script="multichunk.py", config=config_of(args))
    res["config"] = config_of(args)
    print_rows(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
