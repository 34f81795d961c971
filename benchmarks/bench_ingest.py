"""Collector ingest through the full path: a publisher-like websocket client -> collector
(``python -m storage``, its own process) -> SQLite (WAL) on this machine's cores.

For step events of 8, 64 and 256 chunks (plus the request events of a steady decode workload:
arrived / first_scheduled / first_token / finished as requests come and go), the client sends
pre-encoded frames (one every ``--frame-ms``, as the engine's publisher batches them) at a target
rate of step events per second for ``--seconds``, and records for every frame the time from its
send to the ack that covers it (the ack is sent after the commit, so this is the ingest lag
including the database). A rate is *sustained* when the client kept the pace (>= 97% of the
target), every frame was acked, and the p99 lag stayed under ``--max-lag`` seconds (1 s). Rates
double from ``--start-rate`` until one is not sustained in ``--tries`` tries (2: the machine is
shared, and a busy neighbour can stall a try; every try is recorded with the load average); the
highest sustained rate is reported per chunk count, along with the collector's CPU use.

Run from the repo root:  .venv/bin/python -m benchmarks.bench_ingest [--quick]
Writes benchmarks/results/ingest.json (configuration and git state included).

``--compare-tree DIR`` (another checkout, e.g. a ``git worktree`` of an older commit): two
collectors, this tree's and DIR's (its ``storage`` package first on the path), each with its own
store; every rate level of the 64-chunk steps runs on both, alternated (the order flips each
level), so the machine's noise hits both arms. Writes ``ingest_compare.json`` with the ratios
(this tree / DIR) of collector CPU per step and of the highest sustained rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_common_args, config_of, setup, write_json  # noqa: E402
from testkit.collector import start_collector
from testkit.engines import SyntheticEngine, frames

SCRIPT = "bench_ingest.py"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _make_frames(
    chunks: int, rate: float, seconds: float, frame_ms: float, seed: int
) -> tuple[list[tuple[int, str]], int, int, SyntheticEngine, float]:
    """Pre-encoded frames for ``rate`` steps/s over ``seconds``: [(last seq, json)], steps,
    events, the engine, seconds between frames. Steps of ``chunks`` chunks: a steady decode
    batch of ``chunks`` requests."""
    eng = SyntheticEngine(
        engine_id=f"bench-{chunks}-{int(rate)}",
        run_id=f"run-{chunks}-{int(rate)}-{seed}",
        seed=seed,
        concurrency=chunks,
        token_budget=chunks + 32,
        max_token_budget=max(16384, chunks + 32),
        prompt_tokens=(8, 32),
        output_tokens=(64, 256),
        step_ns=int(1e9 / rate),
    )
    n_steps = int(rate * seconds)
    per_frame = max(1, round(rate * frame_ms / 1000))
    out: list[tuple[int, str]] = []
    n_events = 0
    done = 0
    while done < n_steps:
        k = min(per_frame, n_steps - done)
        events = eng.steps(k)
        done += k
        n_events += len(events)
        (frame,) = frames(eng, events, per_frame=len(events))
        out.append((events[-1]["seq"], json.dumps(frame, separators=(",", ":"))))
    return out, n_steps, n_events, eng, per_frame / rate


async def _run_level(
    url: str,
    frames: list[tuple[int, str]],
    hello: dict[str, Any],
    frame_s: float,
    drain_timeout: float,
) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    sent_at: list[float] = []
    lags: list[float] = []
    acked = 0
    done = asyncio.Event()
    last_seq = frames[-1][0]
    async with connect(url + "/ingest", max_size=None, compression=None, proxy=None) as ws:
        await ws.send(json.dumps(hello))
        json.loads(await ws.recv())

        async def reader() -> None:
            nonlocal acked
            i = 0
            async for raw in ws:
                msg = json.loads(raw)
                if msg.get("type") != "ack":
                    continue
                now = time.perf_counter()
                acked = msg["seq"]
                while i < len(sent_at) and frames[i][0] <= acked:
                    lags.append(now - sent_at[i])
                    i += 1
                if acked >= last_seq:
                    done.set()
                    return

        task = asyncio.create_task(reader())
        t0 = time.perf_counter()
        for i, (_, text) in enumerate(frames):
            target = t0 + i * frame_s
            delay = target - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at.append(time.perf_counter())
            await ws.send(text)
        t_sent = time.perf_counter()
        try:
            await asyncio.wait_for(done.wait(), drain_timeout)
        except TimeoutError:
            pass
        t_end = time.perf_counter()
        task.cancel()
    return {
        "send_seconds": t_sent - t0,
        "drain_seconds": t_end - t_sent,
        "frames": len(frames),
        "frames_acked": len(lags),
        "lags": lags,
    }


def _level(proc: Any, n_chunks: int, rate: float, args: argparse.Namespace, attempt: int) -> dict:
    """One try of one rate level: a new run, its frames sent at the pace, acks timed."""
    t = time.perf_counter()
    frames, n_steps, n_events, eng, frame_s = _make_frames(
        n_chunks, rate, args.seconds, args.frame_ms, args.seed * 100 + attempt
    )
    gen_s = time.perf_counter() - t
    cpu0 = _cpu_seconds(proc.process.pid)
    level = asyncio.run(_run_level(proc.url, frames, eng.hello(), frame_s, drain_timeout=30.0))
    cpu = _cpu_seconds(proc.process.pid) - cpu0
    lags = sorted(level.pop("lags"))
    wall = level["send_seconds"] + level["drain_seconds"]
    achieved = n_steps / level["send_seconds"]
    p50 = lags[len(lags) // 2] if lags else None
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None
    row = {
        "chunks_per_step": n_chunks,
        "target_steps_per_s": rate,
        "try": attempt + 1,
        "achieved_steps_per_s": round(achieved, 1),
        "chunk_records_per_s": round(achieved * n_chunks, 1),
        "steps": n_steps,
        "events": n_events,
        "frame_bytes_mean": round(statistics.fmean(len(f[1]) for f in frames)),
        **level,
        "lag_p50_s": p50,
        "lag_p99_s": p99,
        "lag_max_s": lags[-1] if lags else None,
        "collector_cpu_cores": round(cpu / wall, 3),
        "collector_cpu_ms_per_1000_steps": round(1000 * cpu / n_steps * 1000, 2),
        "generate_seconds": round(gen_s, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    row["sustained"] = bool(
        level["frames_acked"] == level["frames"]
        and achieved >= 0.97 * rate
        and p99 is not None
        and p99 < args.max_lag
    )
    print(
        f"chunks={n_chunks:4d} rate={rate:7.0f}/s achieved={achieved:7.0f}/s "
        f"lag p50={p50 or 0:.3f}s p99={p99 or 0:.3f}s max={row['lag_max_s'] or 0:.3f}s "
        f"cpu={row['collector_cpu_cores']:.2f} acked={level['frames_acked']}/{level['frames']} "
        f"{'OK' if row['sustained'] else 'NOT sustained'} (try {attempt + 1}, "
        f"load {row['loadavg_1m']})",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument(
        "--start-rate",
        type=float,
        nargs="+",
        default=[500, 250, 125],
        help="first rate (steps/s) tried for each --chunks value",
    )
    ap.add_argument("--max-rate", type=float, default=16000)
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each rate level")
    ap.add_argument("--frame-ms", type=float, default=20.0, help="publisher batching interval")
    ap.add_argument("--max-lag", type=float, default=1.0, help="p99 lag bound for 'sustained'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tries",
        type=int,
        default=2,
        help="tries of a level before it counts as "
        "not sustained (this machine is shared; every try is recorded)",
    )
    ap.add_argument(
        "--backend",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="store: a SQLite file, or a private PostgreSQL server (initdb in a temporary "
        "folder; fsync off, like a benchmark box, not a production one)",
    )
    ap.add_argument(
        "--compare-tree",
        default=None,
        help="another checkout whose collector runs beside this one's, alternated per level "
        "(64-chunk steps only); writes ingest_compare.json",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="with --compare-tree: run each --start-rate level this many times per arm "
        "(alternated, order flipping) instead of doubling the rate until one is not sustained",
    )
    add_common_args(ap)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.seconds, args.chunks = 1.0, [8, 64]
    if args.compare_tree:
        return _compare(args, out_dir)
    out_path = out_dir / (
        "ingest.json" if args.backend == "sqlite" else f"ingest_{args.backend}.json"
    )
    results: list[dict[str, Any]] = []
    pg = None
    with tempfile.TemporaryDirectory() as tmp:
        db_url = f"sqlite:///{tmp}/ingest.db"
        if args.backend == "postgresql":
            from testkit.postgres import PostgresServer

            pg = PostgresServer.start()
            db_url = pg.create_database("ingest")
        proc = start_collector(db_url, args=["--log-level", "WARNING"])
        try:
            for n_chunks, start in zip(
                args.chunks, args.start_rate * len(args.chunks), strict=False
            ):
                rate = start
                best: dict[str, Any] | None = None
                while rate <= args.max_rate:
                    for attempt in range(args.tries):
                        row = _level(proc, n_chunks, rate, args, attempt)
                        results.append(row)
                        if row["sustained"]:
                            break
                    if not row["sustained"]:
                        break
                    best = row
                    rate *= 2
                print(
                    f"chunks={n_chunks}: highest sustained "
                    f"{best['target_steps_per_s'] if best else None} steps/s",
                    flush=True,
                )
        finally:
            proc.stop()
            if pg is not None:
                pg.stop()
    summary = {}
    for n_chunks in args.chunks:
        ok = [r for r in results if r["chunks_per_step"] == n_chunks and r["sustained"]]
        best = max(ok, key=lambda r: r["target_steps_per_s"]) if ok else None
        summary[str(n_chunks)] = {
            "highest_sustained_steps_per_s": best["target_steps_per_s"] if best else None,
            "chunk_records_per_s": best["chunk_records_per_s"] if best else None,
            "lag_p99_s": best["lag_p99_s"] if best else None,
            "collector_cpu_cores": best["collector_cpu_cores"] if best else None,
        }
    target = summary.get("64", {}).get("highest_sustained_steps_per_s")
    payload = {
        "benchmark": "bench_ingest",
        "loadavg_at_end": os.getloadavg(),
        "setup": {
            "store": "sqlite (WAL, synchronous=NORMAL)"
            if args.backend == "sqlite"
            else "postgresql (private server: fsync=off, synchronous_commit=off)",
            "collector": "python -m storage, separate process",
        },
        "target": "1000 step events/s of 64 chunks with ingest lag < 1 s",
        "target_met": bool(target is not None and target >= 1000),
        "summary": summary,
        "levels": results,
    }
    write_json(out_path, payload, script=SCRIPT, config=config_of(args))
    return 0


def _compare(args: argparse.Namespace, out_dir: Path) -> int:
    """This tree's collector against ``--compare-tree``'s, alternated at each 64-chunk level."""
    other = Path(args.compare_tree).resolve()
    if not (other / "storage" / "collector.py").is_file():
        raise SystemExit(f"--compare-tree {other} is not a chunkscope checkout")
    import subprocess

    other_commit = subprocess.run(
        ["git", "-C", str(other), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = {
            "this": start_collector(f"sqlite:///{tmp}/this.db", args=["--log-level", "WARNING"]),
            "other": start_collector(
                f"sqlite:///{tmp}/other.db",
                args=["--log-level", "WARNING"],
                tree=other,
            ),
        }
        try:
            if args.repeats > 0:
                for level in range(args.repeats):
                    for rate in args.start_rate:
                        order = ["this", "other"] if level % 2 == 0 else ["other", "this"]
                        for arm in order:
                            print(f"[{arm}]", end=" ", flush=True)
                            rows.append({"arm": arm, **_level(procs[arm], 64, rate, args, level)})
            rate = args.start_rate[0] if args.start_rate else 500.0
            alive = {"this": True, "other": True}
            level = 0
            while args.repeats <= 0 and rate <= args.max_rate and any(alive.values()):
                order = ["this", "other"] if level % 2 == 0 else ["other", "this"]
                for arm in order:
                    if not alive[arm]:
                        continue
                    ok = False
                    for attempt in range(args.tries):
                        print(f"[{arm}]", end=" ", flush=True)
                        row = {"arm": arm, **_level(procs[arm], 64, rate, args, attempt)}
                        rows.append(row)
                        if row["sustained"]:
                            ok = True
                            break
                    alive[arm] = ok
                rate *= 2
                level += 1
        finally:
            for p in procs.values():
                p.stop()

    def best(arm: str) -> float | None:
        ok = [r["target_steps_per_s"] for r in rows if r["arm"] == arm and r["sustained"]]
        return max(ok) if ok else None

    def cpu(arm: str) -> float | None:
        # median collector CPU per 1000 steps over the sustained levels both arms ran
        both = {r["target_steps_per_s"] for r in rows if r["sustained"] and r["arm"] == "this"}
        both &= {r["target_steps_per_s"] for r in rows if r["sustained"] and r["arm"] == "other"}
        xs = [
            r["collector_cpu_ms_per_1000_steps"]
            for r in rows
            if r["arm"] == arm and r["sustained"] and r["target_steps_per_s"] in both
        ]
        return statistics.median(xs) if xs else None

    b_this, b_other, c_this, c_other = best("this"), best("other"), cpu("this"), cpu("other")
    payload = {
        "benchmark": "bench_ingest --compare-tree",
        "loadavg_at_end": os.getloadavg(),
        "other_tree": str(other),
        "other_commit": other_commit,
        "summary": {
            "highest_sustained_steps_per_s": {"this": b_this, "other": b_other},
            "ratio_highest_sustained": (b_this / b_other) if b_this and b_other else None,
            "collector_cpu_ms_per_1000_steps_median": {"this": c_this, "other": c_other},
            "ratio_cpu_per_step": (c_this / c_other) if c_this and c_other else None,
        },
        "levels": rows,
    }
    print(json.dumps(payload["summary"], indent=1), flush=True)
    write_json(out_dir / "ingest_compare.json", payload, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
