"""Served throughput with telemetry on against off, on the same workload (target ratio >= 0.99).

Two engine servers (``python -m engine``, process mode, the same flags) run side by side: one
without a collector, one with ``--collector-url`` pointing at a real collector
(``python -m storage`` on a SQLite file in a temporary folder), so the "on" side pays for the
whole publisher path (listener, buffer, encoding, frames, acks) while the collector writes. The
same seeded workload (N concurrent streaming requests x P prompt tokens x O output tokens,
``ignore_eos``) runs against each; passes alternate off / on ``--repeats`` times after a warm-up,
so background load hits both alike. Throughput is output tokens / wall time (first request sent
to the last token received). Because wall time on a shared 2-core machine swings with other
work, each pass also records the CPU seconds the server process and its engine core used
(``/proc``) per output token: on / off of that is the cost of telemetry itself, and its inverse
the throughput ratio when the engine is CPU-bound. After the passes the "on" server's
``/metrics`` must show nothing dropped and every event acknowledged, and the store must hold one
step row per engine step.

Also measured, in this process and far less sensitive to other load: the publisher's own CPU
time per step (publish on the caller's thread, encoding and sending on its thread) for steps of
8, 64 and 256 chunks, against a sink that acks every frame.

Run from the repo root:  .venv/bin/python -m benchmarks.bench_telemetry [--quick]
Writes benchmarks/results/telemetry_overhead.json (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_common_args,
    config_of,
    random_prompt,
    setup,
    start_engine_server,
    write_json,
)

TARGET = 0.99


def start_server(a: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "engine", "--model", a.model, "--port", "0",
        "--token-budget", str(a.token_budget), "--max-model-len", str(a.max_model_len),
        "--device", a.device, "--dtype", a.dtype, "--no-prefix-caching", "--seed", "0",
        "--log-level", "warning", *extra,
    ]  # fmt: skip
    return start_engine_server(cmd)


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (the engine core), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat(p: int) -> list[str] | None:
        try:
            text = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            return None
        return text.rsplit(")", 1)[1].split()  # fields from 3 (state) on

    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        f = stat(int(entry.name))
        if f is not None and (int(entry.name) == pid or int(f[1]) == pid):
            total += (int(f[11]) + int(f[12])) / tick  # utime, stime
    return total


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], a: Any) -> int:
    body = {
        "model": a.model, "prompt": prompt, "max_tokens": a.output_len, "ignore_eos": True,
        "seed": 1, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            if raw.startswith(b"data: {") and b'"usage"' in raw:
                tokens = json.loads(raw[6:])["usage"]["completion_tokens"]
    return tokens


async def _pass(url: str, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(_one(session, url, p, a) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall}


def scrape(url: str) -> dict[str, float]:
    """The ``chunkscope_telemetry_*`` samples and the engine's step count from /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(chunkscope_telemetry_\w+)\{[^}]*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    sched = httpx.get(url + "/v1/scheduler", timeout=30).json()
    out["engine_steps"] = float(sched["step"])
    return out


def wait_acked(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        done = m.get("chunkscope_telemetry_acked_seq", -1) >= m.get(
            "chunkscope_telemetry_last_seq", 0
        )
        if done or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def publisher_cost(num_chunks: int, num_steps: int) -> dict[str, Any]:
    """CPU microseconds per step of the publisher itself, in this process, against a sink that
    acks every frame: ``publish`` on the caller's thread (a step event with ``num_chunks``
    chunks plus two request events per step) and the publisher thread (encoding, frames,
    acks), read from that thread's own CPU clock."""
    from websockets.asyncio.server import serve

    from engine.telemetry import Publisher
    from wire.events import ChunkRecord, RequestEvent, StepEvent

    port: list[int] = []
    started = threading.Event()
    loop = asyncio.new_event_loop()

    async def handler(ws: Any) -> None:
        await ws.recv()
        seq = 0
        await ws.send('{"type":"ack","seq":0}')
        async for raw in ws:
            seq = json.loads(raw)["events"][-1]["seq"]
            await ws.send(json.dumps({"type": "ack", "seq": seq}))

    async def sink() -> None:
        server = await serve(handler, "127.0.0.1", 0, compression=None, max_size=None)
        port.append(server.sockets[0].getsockname()[1])
        started.set()
        await server.wait_closed()

    threading.Thread(target=lambda: loop.run_until_complete(sink()), daemon=True).start()
    started.wait(10)
    events: list[Any] = []
    for i in range(num_steps):
        chunks = [ChunkRecord(f"cmpl-{i * 1000 + j:032x}", "decode", 100 + i, 1, True)
                  for j in range(num_chunks)]  # fmt: skip
        events.append(RequestEvent(kind="arrived", request_id=f"cmpl-{i:032x}", time_ns=i))
        events.append(StepEvent(
            step=i, start_ns=i * 1000, end_ns=i * 1000 + 900, token_budget=512,
            policy="chunked", num_decode_tokens=num_chunks, num_prefill_tokens=0,
            num_scheduled_tokens=num_chunks, num_running=num_chunks, num_waiting=0,
            kv_blocks_used=10, kv_blocks_total=100, num_preemptions=0, chunks=chunks,
            forward_ns=800,
        ))  # fmt: skip
        events.append(RequestEvent(kind="finished", request_id=f"cmpl-{i:032x}", time_ns=i))
    pub = Publisher(f"ws://127.0.0.1:{port[0]}", engine_id="bench", hello=lambda: {}).start()
    deadline = time.monotonic() + 10
    while not pub.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub._thread is not None and pub._thread.ident is not None  # noqa: SLF001
    clock = time.pthread_getcpuclockid(pub._thread.ident)  # noqa: SLF001
    sender0 = time.clock_gettime(clock)
    caller0 = time.thread_time()
    for ev in events:
        pub.publish(ev)
    caller = time.thread_time() - caller0
    assert pub.wait_acked(timeout=120)
    sender = time.clock_gettime(clock) - sender0
    stats = pub.stats()
    pub.close()
    return {
        "num_chunks": num_chunks,
        "num_steps": num_steps,
        "events_per_step": 3,
        "publish_cpu_us_per_step": caller / num_steps * 1e6,
        "publisher_thread_cpu_us_per_step": sender / num_steps * 1e6,
        "frames": stats.frames_sent,
        "events": stats.events_sent,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p)
    # One torch thread per engine core: two engines and a collector share the machine, and
    # spinning OpenMP workers would make both sides' numbers swing by several times.
    p.set_defaults(threads=1)
    a = p.parse_args(argv)
    out_dir = setup(a)
    if a.quick:
        a.num_requests, a.output_len, a.repeats = 8, 16, 1
    if a.threads is not None:  # the engine cores run in child processes
        os.environ["OMP_NUM_THREADS"] = str(a.threads)

    cost = [publisher_cost(n, 200 if a.quick else 2000) for n in (8, 64, 256)]
    for c in cost:
        print(f"publisher, {c['num_chunks']:3d}-chunk steps: publish "
              f"{c['publish_cpu_us_per_step']:.1f} us/step on the caller's thread, "
              f"{c['publisher_thread_cpu_us_per_step']:.1f} us/step on its own thread")  # fmt: skip

    from testkit.collector import start_collector

    rng = random.Random(a.seed)
    prompts = [random_prompt(rng, a.prompt_len) for _ in range(a.num_requests)]
    warm = prompts[: max(2, len(prompts) // 4)]
    tmp = Path(tempfile.mkdtemp(prefix="chunkscope-bench-telemetry-"))
    db_url = f"sqlite:///{tmp / 'bench.db'}"
    load_before = os.getloadavg()[0]
    collector = start_collector(db_url)
    servers: dict[str, tuple[subprocess.Popen[str], str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        servers["off"] = start_server(a, [])
        servers["on"] = start_server(
            a, ["--collector-url", collector.url, "--telemetry-spill-dir", str(tmp / "spill")]
        )
        for _, url in servers.values():
            asyncio.run(_pass(url, warm, a))
        for i in range(a.repeats):  # off, on; then on, off: drift hits both sides alike
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                proc, url = servers[side]
                cpu0 = process_cpu_s(proc.pid)
                run = asyncio.run(_pass(url, prompts, a))
                run["cpu_s"] = process_cpu_s(proc.pid) - cpu0
                run["cpu_ms_per_token"] = run["cpu_s"] * 1e3 / max(1, run["tokens"])
                runs[side].append(run)
                print(f"{side}: {run['tokens_per_s']:.0f} tok/s, "
                      f"{run['cpu_ms_per_token']:.3f} CPU ms/token")  # fmt: skip
        telemetry = wait_acked(servers["on"][1])
    finally:
        for proc, _ in servers.values():
            stop(proc)
        collector.stop()
    stored_steps = _stored_steps(db_url)
    load_after = os.getloadavg()[0]

    def side(rs: list[dict[str, Any]]) -> dict[str, Any]:
        tps = [r["tokens_per_s"] for r in rs]
        cpu = [r["cpu_ms_per_token"] for r in rs]
        return {
            "cpu_ms_per_token_median": statistics.median(cpu),
            "cpu_ms_per_token_min": min(cpu),
            "all_runs_cpu_ms_per_token": cpu,
            "tokens_per_s_best": max(tps),
            "tokens_per_s_median": statistics.median(tps),
            "all_runs_tokens_per_s": tps,
            "output_tokens_per_pass": rs[0]["tokens"],
        }

    off, on = side(runs["off"]), side(runs["on"])
    ratio_best = on["tokens_per_s_best"] / off["tokens_per_s_best"]
    ratio_median = on["tokens_per_s_median"] / off["tokens_per_s_median"]
    cpu_ratio = on["cpu_ms_per_token_median"] / off["cpu_ms_per_token_median"]
    pairs = list(zip(runs["on"], runs["off"], strict=True))
    paired = [n["tokens_per_s"] / f["tokens_per_s"] for n, f in pairs]
    paired_cpu = [n["cpu_ms_per_token"] / f["cpu_ms_per_token"] for n, f in pairs]
    print(f"on/off: best {ratio_best:.3f}, median {ratio_median:.3f} (target {TARGET}); "
          f"CPU per token on/off (median) {cpu_ratio:.3f}")  # fmt: skip
    write_json(
        out_dir / "telemetry_overhead.json",
        {
            "benchmark": "telemetry_overhead",
            "target_ratio": TARGET,
            "ratio_best": ratio_best,
            "ratio_median": ratio_median,
            "meets_target": ratio_best >= TARGET,
            "paired_ratios": paired,
            "paired_ratio_median": statistics.median(paired),
            "paired_cpu_ratios": paired_cpu,
            "paired_cpu_ratio_median": statistics.median(paired_cpu),
            "cpu_per_token_on_over_off_median": cpu_ratio,
            "implied_ratio_when_cpu_bound": 1 / cpu_ratio,
            "off": off,
            "on": on,
            "publisher_cpu_cost": cost,
            "telemetry_metrics_after": telemetry,
            "stored_steps": stored_steps,
            "engine_steps_on_side": telemetry.get("engine_steps"),
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": load_after,
            "note": "2-core machine shared with other work; single-run numbers are noisy",
        },
        script="bench_telemetry.py",
        config=config_of(a),
    )
    return 0


def _stored_steps(db_url: str) -> int | None:
    try:
        from sqlalchemy import create_engine, func, select

        from storage import schema

        db = create_engine(db_url)
        with db.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(schema.steps)).scalar() or 0)
    except Exception as exc:  # noqa: BLE001 - a report detail, not the measurement
        print(f"could not count stored steps: {exc}")
        return None


if __name__ == "__main__":
    raise SystemExit(main())
