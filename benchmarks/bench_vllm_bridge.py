"""The vLLM bridge's own cost per step, without vLLM: what its code adds to vLLM's process.

Each run is its own process: ``StepTranslator.scheduled`` + ``executed`` (what
``ChunkscopeScheduler`` runs on vLLM's busy-loop thread per step, the chunk list built as that
tree's ``vllm.py`` builds it) feed a real ``Publisher`` connected to a collector (a
``python -m storage`` subprocess on SQLite in a temporary folder, shared by all runs, not
counted). Steps are paced (``--step-ms``, a sleep standing for the model's forward, as in vLLM
where steps take a few ms) so that the publisher batches as it does in vLLM. Workload: N running
requests decoding (one chunk each), one finishing and a new one arriving every 16 steps.
Reported per step, for 1, 8 and 64 chunks:

- **core thread**: CPU time (``time.thread_time_ns``) and wall time of the hooks, the work the
  bridge adds to vLLM's busy loop;
- **publisher thread**: its CPU time (``pthread_getcpuclockid``) from the first measured step
  until the collector acknowledged the last event, divided by the steps (encoding, framing,
  websocket, acks, its idle polls: all it costs).

``--compare-tree DIR`` (another checkout, e.g. ``git archive REV | tar -x -C DIR``): every
(size, repeat) runs once with this tree's packages and once with DIR's (first on the path),
the order flipping each time, so the machine's noise hits both arms; the summary gives medians
per arm and the ratios DIR / this tree (how many times cheaper this tree is).

Run from the repo root:  .venv/bin/python -m benchmarks.bench_vllm_bridge [--quick]
Writes benchmarks/results/vllm_bridge_cost.json (configuration and git state included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPT = "bench_vllm_bridge.py"
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
SIZES = (1, 8, 64)


# --- one run (a child process, with the arm's tree first on the path) ------------------------
def child(url: str, n_chunks: int, steps: int, step_ms: float, warmup: int) -> dict[str, Any]:
    from chunkscope.integrations.vllm_events import ScheduledChunk, StepTranslator
    from engine.telemetry.publisher import Publisher
    from wire.events import ClockAnchor

    pub = Publisher(url, engine_id=f"bench-{n_chunks}-{os.getpid()}", hello=lambda: {
        "model": "bench", "policy": "chunked", "token_budget": 512, "max_token_budget": 512,
        "kv_blocks_total": 100, "block_size": 16, "config": {},
        "clock": ClockAnchor.now().to_dict()}).start()  # fmt: skip
    tr = StepTranslator(pub.publish, ClockAnchor.now())
    # Each tree's vllm.py: plain tuples where ScheduledChunk is a tuple, else the objects.
    as_tuples = issubclass(ScheduledChunk, tuple)
    reqs = {f"cmpl-{i:08x}-0-abcdef12": 100 for i in range(n_chunks)}
    for rid in reqs:
        tr.arrived(rid, None, 100)
    if not pub.wait_acked(timeout=30):
        raise SystemExit("the collector did not acknowledge the arrivals")
    thread = pub._thread
    assert thread is not None and thread.ident is not None
    clock = time.pthread_getcpuclockid(thread.ident)
    pace_ns = int(step_ms * 1e6)
    one, prompt = 1, 100
    next_id = n_chunks
    cpu_ns: list[int] = []
    wall_ns: list[int] = []
    pub_cpu0 = frames0 = 0
    for s in range(warmup + steps):
        if s == warmup:
            pub_cpu0 = time.clock_gettime_ns(clock)
            frames0 = pub.stats().frames_sent
        w0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        if as_tuples:
            chunks: list[Any] = [(rid, n, one, prompt, n + 1) for rid, n in reqs.items()]
        else:  # as vllm.py did: int() of each value read off vLLM
            chunks = [ScheduledChunk(rid, int(n), int(one), int(prompt), int(n + 1))
                      for rid, n in reqs.items()]  # fmt: skip
        tr.scheduled(start_ns=time.monotonic_ns(), token_budget=512, chunks=chunks, preempted=[],
                     num_running=len(chunks), num_waiting=0, kv_blocks_used=50,
                     kv_blocks_total=100)  # fmt: skip
        finished: dict[str, Any] = {}
        if s % 16 == 15:
            finished[next(iter(reqs))] = 1
        produced = {rid: 1 for rid in reqs}
        tr.executed(end_ns=time.monotonic_ns(), produced=produced, finished=finished,
                    num_running=len(reqs), num_waiting=0)  # fmt: skip
        for rid in finished:
            del reqs[rid]
            new = f"cmpl-{next_id:08x}-0-abcdef12"
            next_id += 1
            reqs[new] = 100
            tr.arrived(new, None, 100)
        c1 = time.thread_time_ns()
        w1 = time.perf_counter_ns()
        if s >= warmup:
            cpu_ns.append(c1 - c0)
            wall_ns.append(w1 - w0)
        for rid in reqs:
            reqs[rid] += 1
        left = pace_ns - (time.perf_counter_ns() - w0)
        if left > 0:
            time.sleep(left / 1e9)  # the model's forward: the GIL is free meanwhile
    acked = pub.wait_acked(timeout=60)
    pub_cpu = time.clock_gettime_ns(clock) - pub_cpu0
    stats = pub.stats()
    pub.close()
    wall_ns.sort()
    return {
        "chunks_per_step": n_chunks, "steps": steps, "all_acked": acked,
        "core_cpu_us_per_step": sum(cpu_ns) / steps / 1e3,
        "core_wall_us_p50": wall_ns[steps // 2] / 1e3,
        "core_wall_us_p99": wall_ns[min(steps - 1, (99 * steps) // 100)] / 1e3,
        "publisher_cpu_us_per_step": pub_cpu / steps / 1e3,
        "frames": stats.frames_sent - frames0,
        "events_per_step": stats.events_sent / (warmup + steps + n_chunks),
        "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip


def _run_arm(tree: Path, url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(HERE), "--child", url, str(n), str(args.steps), str(args.step_ms),
           str(args.warmup)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"run in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(rows: list[dict[str, Any]], arm: str, n: int, key: str) -> float | None:
    xs = [r[key] for r in rows if r["arm"] == arm and r["chunks_per_step"] == n]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        url, n, steps, step_ms, warmup = argv[1:6]
        print(json.dumps(child(url, int(n), int(steps), float(step_ms), int(warmup))))
        return
    sys.path.insert(0, str(REPO))
    from benchmarks._common import add_common_args, config_of, setup, write_json
    from testkit.collector import start_collector

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=2000, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--step-ms", type=float, default=3.0, help="pace: one step every N ms")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size (and per arm)")
    ap.add_argument("--compare-tree", type=Path, default=None,
                    help="another checkout to alternate with (the 'other' arm)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 200, 20, 1
    out_dir = setup(args)
    arms = {"this": REPO}
    other_commit = None
    if args.compare_tree is not None:
        other = args.compare_tree.resolve()
        if not (other / "chunkscope" / "integrations" / "vllm_events.py").is_file():
            raise SystemExit(f"--compare-tree {other} is not a chunkscope checkout with the bridge")
        arms["other"] = other
        marker = other / "COMMIT"
        other_commit = marker.read_text().strip() if marker.is_file() else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        coll = start_collector(f"sqlite:///{d}/b.db", args=["--log-level", "WARNING"])
        try:
            flip = 0
            for rep in range(args.repeats):
                for n in SIZES:
                    order = list(arms) if flip % 2 == 0 else list(reversed(arms))
                    flip += 1
                    for arm in order:
                        row = {"arm": arm, "repeat": rep, **_run_arm(arms[arm], coll.url, n, args)}
                        rows.append(row)
                        print(f"[{arm:>5}] {n:>2} chunks: core CPU "
                              f"{row['core_cpu_us_per_step']:.1f} us/step (wall p50 "
                              f"{row['core_wall_us_p50']:.1f}), publisher CPU "
                              f"{row['publisher_cpu_us_per_step']:.1f} us/step, "
                              f"{row['frames']} frames, acked {row['all_acked']}",
                              flush=True)  # fmt: skip
        finally:
            coll.stop()
    keys = ("core_cpu_us_per_step", "core_wall_us_p50", "publisher_cpu_us_per_step")
    summary: dict[str, Any] = {}
    for n in SIZES:
        s: dict[str, Any] = {}
        for key in keys:
            s[key] = {arm: _median(rows, arm, n, key) for arm in arms}
        if "other" in arms:
            for key in keys:
                a, b = s[key]["other"], s[key]["this"]
                s[f"ratio_{key}_other_over_this"] = a / b if a and b else None
            both = {arm: s["core_cpu_us_per_step"][arm] + s["publisher_cpu_us_per_step"][arm]
                    for arm in arms}  # fmt: skip
            s["both_threads_cpu_us_per_step"] = both
            s["ratio_both_other_over_this"] = both["other"] / both["this"]
            s["both_threads_share_of_step_pct"] = {
                arm: 100 * v / (args.step_ms * 1e3) for arm, v in both.items()
            }
        summary[str(n)] = s
    print(json.dumps(summary, indent=1))
    write_json(out_dir / "vllm_bridge_cost.json", {
        "other_tree": str(arms.get("other")) if "other" in arms else None,
        "other_commit": other_commit, "loadavg_at_end": os.getloadavg(),
        "summary_medians_by_chunks": summary, "runs": rows,
    }, script=SCRIPT, config=config_of(args))  # fmt: skip


if __name__ == "__main__":
    main()
