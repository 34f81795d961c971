"""Client overhead of the load generator: concurrent streams, chunks/s, and timing error.

A fast local SSE source (loadgen.mockserver, in a subprocess so it has its own core and event
loop) streams chunks on a fixed schedule and reports the wall-clock send time of each chunk.
The client (loadgen's real runner and client code) records each chunk's arrival; the timing
error is client arrival - server send for every chunk (an upper bound on the client's own error:
it also holds the kernel's loopback delivery). Target (issue): >= 200 concurrent streams and
>= 2,000 chunks/s with timing error <= 1 ms. A second phase at twice the rate shows the headroom.

Run: .venv/bin/python benchmarks/bench_loadgen.py   (~40 s; writes
benchmarks/results/loadgen_overhead.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.client import ClientConfig
from loadgen.runner import execute
from loadgen.spec import RequestSpec
from loadgen.tokens import Segment, TokenSource

logger = logging.getLogger("bench_loadgen")
ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "loadgen_overhead.json"


def start_source(interval_ms: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadgen.mockserver",
            "--port",
            "0",
            "--ttft-ms",
            "20",
            "--interval-ms",
            str(interval_ms),
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if m := re.search(r"(http://127\.0\.0\.1:\d+)", line):
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("SSE source did not start")


def phase(streams: int, chunks_per_s: float, seconds: float) -> dict[str, Any]:
    interval_ms = 1000.0 * streams / chunks_per_s
    tokens = max(2, int(seconds * 1000.0 / interval_ms))
    proc, url = start_source(interval_ms)
    try:
        # all streams start within 0.2 s and stay open together for ~`seconds`
        specs = [
            RequestSpec(i, "bench", 0.2 * i / streams, tokens, (Segment(f"b{i}", 8),))
            for i in range(streams)
        ]
        cfg = ClientConfig(base_url=url, model="mock", request_timeout_s=seconds + 60)
        cpu0 = time.process_time()
        out = asyncio.run(
            execute(
                specs, cfg, TokenSource(0), max_concurrency=streams, drain_timeout_s=seconds + 60
            )
        )
        cpu = time.process_time() - cpu0
    finally:
        proc.terminate()
        proc.wait(10)
    recs = out.records
    ok = [r for r in recs if r.status == "ok"]
    errs = [
        (c - s) * 1000.0
        for r in ok
        for c, s in zip(r.chunk_wall, (r.server or {}).get("token_times", []), strict=False)
    ]
    chunks = sum(len(r.chunk_wall) for r in ok)
    first = min(r.chunk_wall[0] for r in ok)
    last = max(r.chunk_wall[-1] for r in ok)
    achieved = chunks / (last - first)
    e = np.asarray(errs)
    res = {
        "streams": streams,
        "target_chunks_per_s": chunks_per_s,
        "tokens_per_stream": tokens,
        "interval_ms": interval_ms,
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "chunks": chunks,
        "achieved_chunks_per_s": achieved,
        "ratio_achieved_to_target": achieved / chunks_per_s,
        "timing_error_ms": {
            "p50": float(np.percentile(e, 50)),
            "p90": float(np.percentile(e, 90)),
            "p99": float(np.percentile(e, 99)),
            "p999": float(np.percentile(e, 99.9)),
            "max": float(e.max()),
            "mean": float(e.mean()),
            "fraction_over_1ms": float(np.mean(e > 1.0)),
        },
        "client_cpu_s": cpu,
        "client_cpu_fraction_of_one_core": cpu / out.duration_s,
        "wall_s": out.duration_s,
    }
    res["ratio_p99_error_to_1ms_budget"] = res["timing_error_ms"]["p99"] / 1.0
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--chunks-per-s", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    phases = [
        phase(a.streams, a.chunks_per_s, a.seconds),
        phase(a.streams, 2 * a.chunks_per_s, a.seconds),
    ]
    result = {
        "benchmark": "loadgen client overhead",
        "created": time.time(),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "target": {
            "streams": a.streams,
            "chunks_per_s": a.chunks_per_s,
            "max_timing_error_ms": 1.0,
        },
        "phases": phases,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    for p in phases:
        t = p["timing_error_ms"]
        print(
            f"{p['streams']} streams, target {p['target_chunks_per_s']:.0f} chunks/s: "
            f"achieved {p['achieved_chunks_per_s']:.0f} chunks/s "
            f"(ratio {p['ratio_achieved_to_target']:.3f}), errors {p['errors']}, "
            f"timing error p50 {t['p50']:.3f} / p99 {t['p99']:.3f} / max {t['max']:.3f} ms "
            f"(p99/1ms budget = {p['ratio_p99_error_to_1ms_budget']:.2f}, "
            f"{100 * t['fraction_over_1ms']:.2f}% chunks over 1 ms), client CPU "
            f"{100 * p['client_cpu_fraction_of_one_core']:.0f}% of a core"
        )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
