"""Does work on the other CPU slow the engine's step? In-process decode-only steps on one CPU
while the other CPU is idle, spins, or streams memory.

Served, the engine's core computes on one CPU while the HTTP side and the client run on the other
(``benchmarks/vllm_peer.py``); its decode-only steps there cost more than the same steps in
process with the other CPU idle, with no run-queue wait (``--step-trace``). This isolates the
neighbour: one process, its thread pinned to ``--core``, the issue-20 model (hidden 256, 4
layers, 4/2 heads, fp32 by default) with ``--streams`` decoding chat streams, and per arm a
helper process pinned to ``--other``: none (``idle``), a pure-Python spin (``spin``: the core's
execution units shared if the two vCPUs are one physical core's threads), or numpy copies of
64 MB arrays (``stream``: caches and memory bandwidth). Arms alternate ``--reps`` times, each
``--steps`` steps; the first steps of each block are dropped.

    flock /work/notes/bench.lock .venv/bin/python -m benchmarks.neighbour_load [--quick]

Writes benchmarks/results/neighbour_load.json (--quick: a few steps, to the quick folder).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_common_args, config_of, setup, write_json

ARMS = ("idle", "spin", "stream")
HELPERS = {
    "spin": "while True: pass",
    "stream": (
        "import numpy as np\n"
        "a = np.ones(16 << 20, dtype=np.float32); b = np.empty_like(a)\n"
        "while True: np.copyto(b, a); np.copyto(a, b)"
    ),
}


def neighbour(arm: str, cpu: int) -> subprocess.Popen[bytes] | None:
    """The helper process of ``arm`` bound to ``cpu`` (None for ``idle``)."""
    if arm == "idle":
        return None
    proc = subprocess.Popen([sys.executable, "-c", HELPERS[arm]])
    os.sched_setaffinity(proc.pid, {cpu})
    time.sleep(0.3)  # let it start
    return proc


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    rng = random.Random(0)
    steps: dict[str, list[float]] = {a: [] for a in args.arms}
    with tempfile.TemporaryDirectory(prefix="neighbour-") as tmp:
        folder = build_llama_folder(Path(tmp) / "model", hidden_size=256, num_layers=4)
        engine = LLMEngine(
            EngineConfig(model=str(folder), token_budget=512, max_model_len=2048,
                         num_kv_blocks=1024, device="cpu", dtype=args.dtype, cpu_threads=1)
        )  # fmt: skip
        params = SamplingParams(max_tokens=1800, temperature=0.0, ignore_eos=True)
        for _ in range(args.streams):
            engine.add_request([rng.randrange(3, 256) for _ in range(200)], params)
        for _ in range(20):  # prefills and warm-up
            engine.step()
        for rep in range(args.reps):
            order = args.arms[rep % len(args.arms) :] + args.arms[: rep % len(args.arms)]
            for arm in order:
                proc = neighbour(arm, args.other)
                try:
                    for k in range(args.steps):
                        t0 = time.perf_counter()
                        engine.step()
                        if k >= 5:
                            steps[arm].append((time.perf_counter() - t0) * 1e3)
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
            # keep the contexts short of the model's length: restart the streams each rep
            if engine.has_unfinished_requests():
                for rid in list(engine._requests):  # noqa: SLF001 - benchmark bookkeeping
                    engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    engine.step()
                for _ in range(args.streams):
                    engine.add_request([rng.randrange(3, 256) for _ in range(200)], params)
                for _ in range(20):
                    engine.step()
    per_arm = {
        a: {
            "steps": len(xs),
            "decode_step_p50_ms": statistics.median(xs),
            "decode_step_p10_ms": sorted(xs)[len(xs) // 10],
            "decode_step_p90_ms": sorted(xs)[len(xs) * 9 // 10],
        }
        for a, xs in steps.items()
        if xs
    }
    idle = per_arm.get("idle", {}).get("decode_step_p50_ms")
    ratios = {f"{a} over idle": v["decode_step_p50_ms"] / idle for a, v in per_arm.items() if idle}
    return {"per_arm": per_arm, "ratios": ratios, "loadavg_after": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--core", type=int, default=0, help="the CPU the engine computes on")
    ap.add_argument("--other", type=int, default=1, help="the CPU the neighbour runs on")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=6)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.reps = 10, 1
    args.arms = [a for a in args.arms.split(",") if a]
    for a in args.arms:
        if a not in ARMS:
            ap.error(f"--arms: {a!r} is not one of {ARMS}")
    cpus = os.sched_getaffinity(0)
    if args.core not in cpus or args.other not in cpus or args.core == args.other:
        ap.error(f"--core and --other must be two different CPUs of {sorted(cpus)}")
    out_dir = setup(args)
    res = bench(args)
    write_json(out_dir / "neighbour_load.json", res, script="neighbour_load.py",
               config=config_of(args))  # fmt: skip
    for a, v in res["per_arm"].items():
        p50, p10, p90 = (v[f"decode_step_{q}_ms"] for q in ("p50", "p10", "p90"))
        print(f"{a:7s} decode step p50 {p50:.2f} ms (p10 {p10:.2f}, p90 {p90:.2f})")
    print(res["ratios"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
