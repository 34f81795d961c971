"""How much does this machine's own speed move from one sweep window to the next, with nothing
else running? The same fixed work, timed again and again for ``--duration`` seconds.

The advisor's holdout (``benchmarks/advisor.py``) fits a step-cost model on one 45 s window and
checks it on others minutes later; every figure it compares is a 45 s window's. When the
windows' steps run 0.8-1.3x the fit's prediction, that is either the model (a term it lacks) or
the machine (a shared VM's neighbours, the hypervisor's steal). This tells the two apart without
any model: each probe, every ``--pause`` seconds, times

- a fixed fp32 GEMM (2048x512 @ 512x1536, median of 10: ``contention_probe``'s),
- one prefill step of ``--prefill`` tokens on the ``--preset`` engine (median of 3),
- ``--batch`` decoding requests' steady decode steps on that engine (median of 10),

and reads the CPU time the hypervisor took from this VM (``steal`` in ``/proc/stat``) since the
last probe. Then per kind: the median over the run, and the medians of consecutive ``--window``
second spans relative to it (what a window of the holdout would see).

    flock /work/notes/bench.lock .venv/bin/python -m benchmarks.machine_drift --threads 1

Writes ``machine_drift.json`` (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    add_common_args,
    config_of,
    decode_steps,
    drain,
    make_engine,
    prefill_step,
    setup,
    write_json,
)

SCRIPT = "machine_drift.py"
KINDS = ("gemm_ms", "prefill_ms", "decode_ms")
PROC_STAT = Path("/proc/stat")


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from ``/proc/stat``; None where there is none."""
    try:
        first = PROC_STAT.read_text().splitlines()[0].split()
    except OSError:
        return None
    if first[0] != "cpu" or len(first) < 9:
        return None
    vals = [int(x) for x in first[1:]]
    return vals[7], sum(vals)


def window_ratios(
    times: Sequence[float], values: Sequence[float], window_s: float
) -> list[dict[str, float]]:
    """The median of ``values`` over consecutive ``window_s`` spans of ``times`` (from the first
    time on; a last span shorter than half a window is left out), each over the median of all."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if len(times) != len(values):
        raise ValueError("times and values differ in length")
    if not values:
        return []
    whole = statistics.median(values)
    t0, end = times[0], times[-1]
    out = []
    k = 0
    while t0 + k * window_s <= end:
        lo, hi = t0 + k * window_s, t0 + (k + 1) * window_s
        span = [v for t, v in zip(times, values, strict=True) if lo <= t < hi]
        k += 1
        if not span or min(hi, end) - lo < window_s / 2:
            continue
        out.append(
            {"start_s": lo - t0, "probes": len(span), "ratio": statistics.median(span) / whole}
        )
    return out


def summarize(probes: list[dict[str, float]], window_s: float) -> dict[str, Any]:
    """Per kind: the run's median, each window's median over it, their range, and how many
    windows moved more than 10% and 15% from it."""
    times = [p["t_s"] for p in probes]
    out: dict[str, Any] = {}
    for kind in KINDS:
        vals = [p[kind] for p in probes]
        wins = window_ratios(times, vals, window_s)
        ratios = [w["ratio"] for w in wins]
        out[kind] = {
            "median": statistics.median(vals) if vals else None,
            "probe_ratio_range": [
                min(vals) / statistics.median(vals),
                max(vals) / statistics.median(vals),
            ]
            if vals
            else None,
            "windows": wins,
            "window_ratio_range": [min(ratios), max(ratios)] if ratios else None,
            "windows_beyond_10pct": sum(abs(r - 1) > 0.10 for r in ratios),
            "windows_beyond_15pct": sum(abs(r - 1) > 0.15 for r in ratios),
        }
    steal = [p["steal_share"] for p in probes if p.get("steal_share") is not None]
    out["steal_share"] = {
        "mean": statistics.fmean(steal) if steal else None,
        "max": max(steal) if steal else None,
    }
    return out


def probe(engine: Any, rng: random.Random, args: argparse.Namespace) -> dict[str, float]:
    """One probe's timings (milliseconds)."""
    import torch

    a, w = torch.randn(2048, 512), torch.randn(512, 1536)
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ w
        ts.append(time.perf_counter() - t0)
    pf = [prefill_step(engine, rng, args.prefill)[1] for _ in range(3)]
    dec = [wall for _, wall in decode_steps(engine, rng, args.batch, 64, 3, 10, args.prefill)]
    drain(engine)
    return {
        "gemm_ms": statistics.median(ts) * 1e3,
        "prefill_ms": statistics.median(pf) * 1e3,
        "decode_ms": statistics.median(dec) * 1e3,
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine = make_engine(args.preset, token_budget=args.prefill, max_model_len=4096)
    rng = random.Random(args.seed)
    probe(engine, rng, args)  # warm-up, not kept
    probes: list[dict[str, float]] = []
    start = time.perf_counter()
    last = cpu_times()
    while time.perf_counter() - start < args.duration:
        row: dict[str, Any] = {"t_s": time.perf_counter() - start, **probe(engine, rng, args)}
        now = cpu_times()
        if last is not None and now is not None and now[1] > last[1]:
            row["steal_share"] = (now[0] - last[0]) / (now[1] - last[1])
        last = now
        row["loadavg_1m"] = os.getloadavg()[0]
        probes.append(row)
        time.sleep(args.pause)
    return {"probes": probes, "summary": summarize(probes, args.window)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of probes")
    ap.add_argument("--window", type=float, default=45.0, help="the holdout's window (s)")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between probes")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--prefill", type=int, default=512, help="the prefill step's tokens")
    ap.add_argument("--batch", type=int, default=8, help="requests in the decode steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.duration, args.window, args.pause = 6.0, 2.0, 0.2
    if args.duration <= 0 or args.window <= 0 or args.pause < 0:
        ap.error("--duration and --window must be > 0, --pause >= 0")
    if args.prefill < 1 or args.batch < 1:
        ap.error("--prefill and --batch must be >= 1")
    out_dir = setup(args)
    res = bench(args)
    s = res["summary"]
    for kind in KINDS:
        rng_ = s[kind]["window_ratio_range"]
        print(
            f"{kind}: median {s[kind]['median']:.2f}, {args.window:g} s windows "
            f"{rng_[0]:.2f}-{rng_[1]:.2f}x, beyond 10%: {s[kind]['windows_beyond_10pct']}, "
            f"beyond 15%: {s[kind]['windows_beyond_15pct']} of {len(s[kind]['windows'])}"
            if rng_
            else f"{kind}: no windows"
        )
    write_json(out_dir / "machine_drift.json", res, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
