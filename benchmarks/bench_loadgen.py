"""Client overhead of the load generator: concurrent streams, chunks/s, and timing error.

A fast local SSE source (loadgen.mockserver, in a subprocess so it has its own event loop)
streams chunks on a fixed schedule and reports the wall-clock send time of every chunk. The
loadgen client (its real runner and client code) stamps each chunk's arrival; timing error =
client stamp - server send time, per chunk. That also holds the kernel's loopback delivery and
waiting for a core (two processes on 2 cores), so the same streams are also received by a
minimal raw-socket baseline (an asyncio Protocol that stamps in `data_received` and parses
nothing): loadgen's own overhead is the difference. Target (issue): >= 200 concurrent streams and
>= 2,000 chunks/s with timing error <= 1 ms; a second rate at twice that shows the headroom.

Run: .venv/bin/python -m benchmarks.bench_loadgen [--quick]  (~45 s; writes
benchmarks/results/loadgen_overhead.json with provenance and the full configuration; --quick:
2-second runs, results to a temporary folder)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import add_common_args, config_of, setup, write_json  # noqa: E402
from loadgen.client import ClientConfig
from loadgen.runner import execute
from loadgen.spec import RequestSpec
from loadgen.tokens import Segment, TokenSource

logger = logging.getLogger("bench_loadgen")
ROOT = Path(__file__).resolve().parents[1]
STAGGER_S = 0.2  # streams start spread over this, then all stay open together
TOKEN_TIMES = re.compile(rb'"token_times":\[([^\]]*)\]')


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


def _q(values: list[float]) -> dict[str, float]:
    e = np.asarray(values, dtype=float)
    return {
        "p50": float(np.percentile(e, 50)),
        "p90": float(np.percentile(e, 90)),
        "p99": float(np.percentile(e, 99)),
        "p999": float(np.percentile(e, 99.9)),
        "max": float(e.max()),
        "mean": float(e.mean()),
        "fraction_over_1ms": float(np.mean(e > 1.0)),
    }


async def _with_lag_probe(work: Any) -> tuple[Any, list[float]]:
    """Run `work` and, beside it, the event loop's own lag (1 ms sleeps), in ms."""
    lags: list[float] = []
    task = asyncio.ensure_future(work)
    for _ in range(10_000_000):
        if task.done():
            break
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - t - 0.001) * 1000.0)
    return await task, lags


def run_loadgen(url: str, streams: int, tokens: int, timeout: float) -> dict[str, Any]:
    specs = [
        RequestSpec(i, "bench", STAGGER_S * i / streams, tokens, (Segment(f"b{i}", 8),))
        for i in range(streams)
    ]
    cfg = ClientConfig(base_url=url, model="mock", request_timeout_s=timeout)
    cpu0 = time.process_time()
    out, lags = asyncio.run(
        _with_lag_probe(
            execute(specs, cfg, TokenSource(0), max_concurrency=streams, drain_timeout_s=timeout)
        )
    )
    cpu = time.process_time() - cpu0
    ok = [r for r in out.records if r.status == "ok"]
    pairs = [
        (c, s)
        for r in ok
        for c, s in zip(r.chunk_wall, (r.server or {}).get("token_times", []), strict=False)
    ]
    late = [
        (s - d) * 1000.0
        for r in ok
        for s, d in zip(r.server["token_times"], r.server["due_times"], strict=False)
    ]  # type: ignore[index]
    return {
        "errors": len(out.records) - len(ok),
        "pairs": pairs,
        "lag": lags,
        "late": late,
        "cpu_fraction": cpu / out.duration_s,
    }


class _Recv(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done, self.buf, self.times = done, bytearray(), []  # type: ignore[var-annotated]

    def data_received(self, data: bytes) -> None:
        t = time.time()
        self.times.extend([t] * data.count(b'"text":"x"'))
        self.buf += data

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _baseline(url: str, streams: int, tokens: int, timeout: float) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {"model": "mock", "prompt": [65] * 8, "max_tokens": tokens, "stream": True}
    ).encode()
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    recvs: list[_Recv] = []
    t0 = time.perf_counter()
    for i in range(streams):
        delay = t0 + STAGGER_S * i / streams - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        done: asyncio.Future[None] = loop.create_future()
        transport, proto = await loop.create_connection(lambda d=done: _Recv(d), host, int(port))
        transport.write(req)  # type: ignore[union-attr]
        recvs.append(proto)
    await asyncio.wait_for(asyncio.gather(*(r.done for r in recvs)), timeout)
    pairs: list[tuple[float, float]] = []
    errors = 0
    for r in recvs:
        m = TOKEN_TIMES.search(bytes(r.buf))
        if not m or len(r.times) != tokens:
            errors += 1
            continue
        pairs += zip(r.times, (float(v) for v in m.group(1).split(b",")), strict=True)
    return {"errors": errors, "pairs": pairs}


def run_baseline(url: str, streams: int, tokens: int, timeout: float) -> dict[str, Any]:
    out, lags = asyncio.run(_with_lag_probe(_baseline(url, streams, tokens, timeout)))
    return {**out, "lag": lags}


def measure(client: str, streams: int, chunks_per_s: float, seconds: float) -> dict[str, Any]:
    interval_ms = 1000.0 * streams / chunks_per_s
    tokens = max(2, int(seconds * 1000.0 / interval_ms))
    proc, url = start_source(interval_ms)
    load0 = os.getloadavg()[0]
    try:
        run = run_loadgen if client == "loadgen" else run_baseline
        got = run(url, streams, tokens, seconds + 60)
    finally:
        proc.terminate()
        proc.wait(10)
    pairs = got["pairs"]
    stamps, sends = [c for c, _ in pairs], [s for _, s in pairs]
    res = {
        "client": client,
        "streams": streams,
        "target_chunks_per_s": chunks_per_s,
        "tokens_per_stream": tokens,
        "interval_ms": interval_ms,
        "stream_errors": got["errors"],
        "chunks": len(pairs),
        "achieved_chunks_per_s": len(pairs) / (max(stamps) - min(stamps)),
        "offered_chunks_per_s": len(pairs) / (max(sends) - min(sends)),  # the server's pace
        "timing_error_ms": _q([(c - s) * 1000.0 for c, s in pairs]),
        "client_loop_lag_ms": _q(got["lag"]),
        "load_average_1min": [load0, os.getloadavg()[0]],
    }
    res["ratio_achieved_to_target"] = res["achieved_chunks_per_s"] / chunks_per_s
    res["ratio_achieved_to_offered"] = res["achieved_chunks_per_s"] / res["offered_chunks_per_s"]
    if client == "loadgen":
        res["server_send_lateness_ms"] = _q(got["late"])
        res["client_cpu_fraction_of_one_core"] = got["cpu_fraction"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--chunks-per-s", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each run")
    add_common_args(ap)
    a = ap.parse_args(argv)
    out_dir = setup(a)
    if a.quick:
        a.seconds = min(a.seconds, 2.0)
    rates, lines, runs = [a.chunks_per_s, 2 * a.chunks_per_s], [], []
    for rate in rates:
        lg = measure("loadgen", a.streams, rate, a.seconds)
        base = measure("baseline", a.streams, rate, a.seconds)
        e, b = lg["timing_error_ms"], base["timing_error_ms"]
        over = {q: e[q] - b[q] for q in ("p50", "p90", "p99", "mean")}
        runs.append({"loadgen": lg, "baseline": base, "loadgen_minus_baseline_ms": over})
        lines.append(
            f"{a.streams} streams @ {rate:.0f} chunks/s: loadgen achieved "
            f"{lg['achieved_chunks_per_s']:.0f}/s (ratio to target "
            f"{lg['ratio_achieved_to_target']:.3f}, to the source's actual pace "
            f"{lg['ratio_achieved_to_offered']:.3f}), "
            f"stream errors {lg['stream_errors']}, CPU "
            f"{100 * lg['client_cpu_fraction_of_one_core']:.0f}% of a core\n"
            f"  timing error ms   loadgen p50 {e['p50']:.3f} p90 {e['p90']:.3f} p99 {e['p99']:.3f}"
            f" max {e['max']:.2f} | baseline p50 {b['p50']:.3f} p90 {b['p90']:.3f} p99 "
            f"{b['p99']:.3f} max {b['max']:.2f}\n"
            f"  loadgen overhead (loadgen - baseline) p50 {over['p50']:.3f} p90 "
            f"{over['p90']:.3f} p99 {over['p99']:.3f} ms; ratio to the 1 ms budget: p50 "
            f"{e['p50'] / 1.0:.2f}, p90 {e['p90'] / 1.0:.2f}, p99 {e['p99'] / 1.0:.2f}"
        )
    result = {
        "benchmark": "loadgen client overhead",
        "target": {
            "streams": a.streams,
            "chunks_per_s": a.chunks_per_s,
            "max_timing_error_ms": 1.0,
        },
        "runs": runs,
    }
    write_json(
        out_dir / "loadgen_overhead.json", result, script="bench_loadgen.py", config=config_of(a)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
