"""The vLLM bridge's own cost per step, without vLLM: what its code adds to vLLM's core thread.

``StepTranslator.scheduled`` + ``executed`` (what ``ChunkscopeScheduler`` runs per step, besides
reading vLLM's state) feed a real ``Publisher`` connected to a real collector (in this process,
SQLite in a temporary folder). Steps of 1, 8 and 64 chunks (decodes of running requests, one of
them finishing and a new one arriving every 16 steps). Reported per step: the core thread's time
(wall, the caller's share) and the whole process's CPU time (publisher thread's encoding and the
collector included, an upper bound). Compare with vLLM's step times (``vllm_story.json``).

Run from the repo root:  .venv/bin/python benchmarks/bench_vllm_bridge.py [--quick]
Writes benchmarks/results/vllm_bridge_cost.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import add_common_args, config_of, setup, write_json  # noqa: E402

from chunkscope.integrations.vllm_events import ScheduledChunk, StepTranslator  # noqa: E402
from engine.telemetry.publisher import Publisher
from testkit.collector import collector_in_thread
from wire.events import ClockAnchor  # noqa: E402

SCRIPT = "bench_vllm_bridge.py"


def run(url: str, n_chunks: int, n_steps: int) -> dict[str, Any]:
    pub = Publisher(url, engine_id=f"bench-{n_chunks}", hello=lambda: {
        "model": "bench", "policy": "chunked", "token_budget": 512, "max_token_budget": 512,
        "kv_blocks_total": 100, "block_size": 16, "config": {},
        "clock": ClockAnchor.now().to_dict()}).start()  # fmt: skip
    tr = StepTranslator(pub.publish, ClockAnchor.now())
    reqs = {f"cmpl-{i:08x}-0-abcdef12": 100 for i in range(n_chunks)}
    for rid in reqs:
        tr.arrived(rid, None, 100)
    next_id = n_chunks
    per_step = np.empty(n_steps)
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    for s in range(n_steps):
        t0 = time.perf_counter_ns()
        chunks = [ScheduledChunk(rid, n, 1, 100, n + 1) for rid, n in reqs.items()]
        tr.scheduled(start_ns=time.monotonic_ns(), token_budget=512, chunks=chunks, preempted=[],
                     num_running=len(chunks), num_waiting=0, kv_blocks_used=50,
                     kv_blocks_total=100)  # fmt: skip
        finished = {}
        if s % 16 == 15:
            done = next(iter(reqs))
            finished[done] = 1
        tr.executed(end_ns=time.monotonic_ns(), produced={rid: 1 for rid in reqs},
                    finished=finished)  # fmt: skip
        for rid in finished:
            del reqs[rid]
            new = f"cmpl-{next_id:08x}-0-abcdef12"
            next_id += 1
            reqs[new] = 100
            tr.arrived(new, None, 100)
        for rid in reqs:
            reqs[rid] += 1
        per_step[s] = (time.perf_counter_ns() - t0) / 1e3
    wall = time.perf_counter() - wall0
    acked = pub.wait_acked(timeout=60)
    cpu = time.process_time() - cpu0
    pub.close()
    return {
        "chunks_per_step": n_chunks, "steps": n_steps, "all_acked": acked,
        "core_thread_us_p50": float(np.percentile(per_step, 50)),
        "core_thread_us_p99": float(np.percentile(per_step, 99)),
        "core_thread_us_mean": float(per_step.mean()),
        "process_cpu_us_per_step": cpu / n_steps * 1e6, "wall_s": wall,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=5000)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 300
    out_dir = setup(args)
    rows = []
    with tempfile.TemporaryDirectory() as d, collector_in_thread(f"sqlite:///{d}/b.db") as coll:
        for n in (1, 8, 64):
            row = run(coll.url, n, args.steps)
            rows.append(row)
            cpu = row["process_cpu_us_per_step"]
            print(f"{n:>3} chunks: core thread p50 {row['core_thread_us_p50']:.0f} us, p99 "
                  f"{row['core_thread_us_p99']:.0f} us; process CPU {cpu:.0f} us/step "
                  f"(collector included); acked {row['all_acked']}")  # fmt: skip
    write_json(out_dir / "vllm_bridge_cost.json", {"rows": rows}, script=SCRIPT,
               config=config_of(args))  # fmt: skip


if __name__ == "__main__":
    main()
