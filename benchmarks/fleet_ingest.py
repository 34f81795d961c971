"""Fleet ingest: 1, 2 and 3 collectors (``python -m storage``, one process each) on one private
PostgreSQL server, synthetic engines on loopback spread over them, steps of 64 chunks.

For each number of collectors, ``--engines`` synthetic engines (each a websocket client sending
pre-encoded frames of a steady 64-request decode batch with its request events, one frame every
``--frame-ms``, as the publisher batches them) connect round-robin to the collectors and send at
a total rate of step events per second for ``--seconds``; every frame's ack is timed (the ack
follows the commit). A total rate is *sustained* when every engine kept the pace (>= 97%), every
frame was acked and the p99 ack lag stayed under ``--max-lag`` s. Rates double from
``--start-rate`` until one is not sustained in ``--tries`` tries; then rates between the last
sustained one and that one are tried (a quarter of the gap up each time) until the step is under
``--resolution``. Reported per collector count: the highest sustained total rate, the CPU each
collector, the PostgreSQL server and the synthetic engines (this process) used at that rate
(cores = CPU seconds / wall seconds), and steps per collector-CPU-second, the figure that
predicts a machine with more cores.

The clients, the collectors and PostgreSQL share this machine's cores: with few cores, more
collectors compete for the same CPUs (the CPU use says where the time went).

Run from the repo root:  .venv/bin/python -m benchmarks.fleet_ingest [--quick]
Writes benchmarks/results/fleet_ingest.json (configuration and git state included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_common_args, config_of, setup, write_json
from benchmarks.bench_ingest import _cpu_seconds, _make_frames, _run_level
from testkit.collector import CollectorProcess, start_collector
from testkit.postgres import PostgresServer

SCRIPT = "fleet_ingest.py"
CHUNKS = 64


def _postgres_cpu(server: PostgresServer) -> float:
    """CPU seconds of the PostgreSQL server: the postmaster and its children."""
    try:
        master = int((server.datadir / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == master or int(stat[1]) == master:
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _all(
    urls: list[str], per_engine: list[tuple[list[tuple[int, str]], dict[str, Any], float]]
) -> list[dict[str, Any]]:
    return await asyncio.gather(
        *(
            _run_level(urls[i % len(urls)], frames, hello, frame_s, drain_timeout=30.0)
            for i, (frames, hello, frame_s) in enumerate(per_engine)
        )
    )


def _level(
    procs: list[CollectorProcess],
    pg: PostgresServer,
    rate: float,
    args: argparse.Namespace,
    attempt: int,
) -> dict[str, Any]:
    """One try of one total rate over every engine and collector."""
    per_rate = rate / args.engines
    per_engine = []
    n_steps = 0
    for e in range(args.engines):
        frames, steps, _, eng, frame_s = _make_frames(
            CHUNKS, per_rate, args.seconds, args.frame_ms, args.seed * 1000 + attempt * 100 + e
        )
        hello = eng.hello()
        hello["engine_id"] = f"fleet-{len(procs)}-{e}-{int(rate)}-{attempt}"
        for i, (seq, text) in enumerate(frames):
            frames[i] = (seq, text.replace(eng.engine_id, hello["engine_id"], 1))
        per_engine.append((frames, hello, frame_s))
        n_steps += steps
    cpu0 = [_cpu_seconds(p.process.pid) for p in procs]
    pg0 = _postgres_cpu(pg)
    client0 = time.process_time()
    t0 = time.perf_counter()
    levels = asyncio.run(_all([p.url for p in procs], per_engine))
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - client0
    cpu = [_cpu_seconds(p.process.pid) - c for p, c in zip(procs, cpu0, strict=True)]
    pg_cpu = _postgres_cpu(pg) - pg0
    lags = sorted(x for lv in levels for x in lv["lags"])
    send = max(lv["send_seconds"] for lv in levels)
    achieved = n_steps / send
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None
    acked = sum(lv["frames_acked"] for lv in levels)
    frames_total = sum(lv["frames"] for lv in levels)
    row = {
        "collectors": len(procs),
        "engines": args.engines,
        "target_steps_per_s": rate,
        "try": attempt + 1,
        "achieved_steps_per_s": round(achieved, 1),
        "steps": n_steps,
        "frames": frames_total,
        "frames_acked": acked,
        "lag_p50_s": lags[len(lags) // 2] if lags else None,
        "lag_p99_s": p99,
        "wall_seconds": round(wall, 2),
        "collector_cpu_seconds": [round(c, 2) for c in cpu],
        "collector_cpu_cores": [round(c / wall, 3) for c in cpu],
        "postgres_cpu_cores": round(pg_cpu / wall, 3),
        "clients_cpu_cores": round(client_cpu / wall, 3),  # the synthetic engines (this process)
        "steps_per_collector_cpu_second": round(n_steps / sum(cpu), 1) if sum(cpu) else None,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    row["sustained"] = bool(
        acked == frames_total and achieved >= 0.97 * rate and p99 is not None and p99 < args.max_lag
    )
    print(
        f"collectors={len(procs)} rate={rate:6.0f}/s achieved={achieved:6.0f}/s "
        f"p99={p99 or 0:.3f}s cpu={row['collector_cpu_cores']} pg={row['postgres_cpu_cores']} "
        f"clients={row['clients_cpu_cores']} "
        f"acked={acked}/{frames_total} {'OK' if row['sustained'] else 'NOT sustained'} "
        f"(try {attempt + 1}, load {row['loadavg_1m']})",
        flush=True,
    )
    return row


def _sustained(
    procs: list[CollectorProcess],
    pg: PostgresServer,
    rate: float,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The first of ``args.tries`` tries of ``rate`` that was sustained (None: none was); every
    try is added to ``rows``."""
    for attempt in range(args.tries):
        row = _level(procs, pg, rate, args, attempt)
        rows.append(row)
        if row["sustained"]:
            return row
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collectors", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--engines", type=int, default=6, help="synthetic engines (default 6)")
    ap.add_argument("--start-rate", type=float, default=1000.0, help="first total steps/s")
    ap.add_argument("--max-rate", type=float, default=64000.0)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each rate level")
    ap.add_argument("--frame-ms", type=float, default=20.0, help="publisher batching interval")
    ap.add_argument("--max-lag", type=float, default=1.0, help="p99 lag bound for 'sustained'")
    ap.add_argument("--tries", type=int, default=2, help="tries of a level (shared machine)")
    ap.add_argument(
        "--resolution",
        type=float,
        default=500.0,
        help="once a doubled rate is not sustained, rates between it and the last sustained one "
        "are tried until the step is below this many steps/s",
    )
    ap.add_argument("--seed", type=int, default=0)
    add_common_args(ap)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.seconds, args.collectors, args.max_rate = 1.0, [1, 2], 2000.0
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    pg = PostgresServer.start()
    try:
        for n in args.collectors:
            db_url = pg.create_database(f"fleet{n}")
            procs = [start_collector(db_url, args=["--log-level", "WARNING"]) for _ in range(n)]
            best: dict[str, Any] | None = None

            try:
                rate, failed = args.start_rate, None
                while rate <= args.max_rate:
                    row = _sustained(procs, pg, rate, args, rows)
                    if row is None:
                        failed = rate
                        break
                    best = row
                    rate *= 2
                # between the highest sustained rate and the first one that was not, in steps
                # of a quarter of the gap (the doubling alone says only "at least half of it")
                while best is not None and failed is not None:
                    rate = best["target_steps_per_s"] + 0.25 * (failed - best["target_steps_per_s"])
                    if rate - best["target_steps_per_s"] < args.resolution:
                        break
                    row = _sustained(procs, pg, rate, args, rows)
                    if row is None:
                        failed = rate
                    else:
                        best = row
            finally:
                for p in procs:
                    p.stop()
            mine = [r for r in rows if r["collectors"] == n and r["steps_per_collector_cpu_second"]]
            summary[str(n)] = {
                # every level, sustained or not: what one collector-CPU-second stores
                "steps_per_collector_cpu_second_median": statistics.median(
                    r["steps_per_collector_cpu_second"] for r in mine
                )
                if mine
                else None,
                "highest_sustained_steps_per_s": best["target_steps_per_s"] if best else None,
                "collector_cpu_cores": best["collector_cpu_cores"] if best else None,
                "postgres_cpu_cores": best["postgres_cpu_cores"] if best else None,
                "clients_cpu_cores": best["clients_cpu_cores"] if best else None,
                "steps_per_collector_cpu_second": best["steps_per_collector_cpu_second"]
                if best
                else None,
                "lag_p99_s": best["lag_p99_s"] if best else None,
            }
            print(f"collectors={n}: {json.dumps(summary[str(n)])}", flush=True)
    finally:
        pg.stop()
    per_cpu = [
        r["steps_per_collector_cpu_second"]
        for r in rows
        if r["sustained"] and r["steps_per_collector_cpu_second"]
    ]
    payload = {
        "benchmark": "fleet_ingest",
        "loadavg_at_end": os.getloadavg(),
        "setup": {
            "store": "postgresql (private server on this machine: fsync=off, "
            "synchronous_commit=off)",
            "collectors": "python -m storage, one process each, all on one database",
            "engines": f"{args.engines} synthetic websocket clients, round-robin over the "
            f"collectors, steps of {CHUNKS} chunks",
        },
        "summary": summary,
        "steps_per_collector_cpu_second_median": statistics.median(per_cpu) if per_cpu else None,
        "levels": rows,
    }
    write_json(out_dir / "fleet_ingest.json", payload, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
