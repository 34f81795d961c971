"""HTTP streaming vs offline throughput on the same workload, and added latency per token.

The same seeded workload (N requests x P prompt tokens x O output tokens, ignore_eos) runs

  offline  through ``LLMEngine`` directly (all requests added, ``step()`` until done), and
  http     through ``python -m engine`` in a subprocess, driven by N concurrent streaming
           aiohttp clients (``/v1/completions``, ``stream_options.include_usage``), in both
           server modes: ``thread`` (``--engine-in-thread``: the step loop shares the HTTP
           process's GIL) and ``process`` (the default: the engine core in a child process).

Throughput is output tokens / wall time (first request sent to last token received). The
offline side also runs with the torch thread count the servers' engine cores use (every CPU but
one, left to the HTTP side): against it the ratio is the cost of serving itself; against offline
with the process's default threads it includes the CPU the server keeps for its HTTP side. Added
latency per streamed token is (client receive time of the chunk) - (engine token time from the
``chunkscope.token_times`` extension), both wall clock on the same machine. Each side runs a
warm-up pass first; measured passes alternate offline / thread / process ``--repeats`` times
(so load from other processes hits all alike); best and median are reported, with the 1-minute
load average before and after.

Run from the repo root:  .venv/bin/python -m benchmarks.bench_server [--models tiny,demo] [--quick]
Writes benchmarks/results/server_throughput.json (provenance and full configuration included;
--quick: tiny only, 8 requests x 16 tokens, one pass, results to a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
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

logger = logging.getLogger("bench_server")


def workload(n: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, prompt_len) for _ in range(n)]


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": a.model,
        "token_budget": a.token_budget,
        "max_model_len": a.max_model_len,
        "device": a.device,
        "dtype": a.dtype,
        "enable_prefix_caching": False,
        "seed": 0,
    }


class Offline:
    """The offline side: one engine, the workload run to completion with ``step()``, with
    ``threads`` torch threads during a pass (None: the process's own setting)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from engine.core.config import EngineConfig
        from engine.core.sampling_params import SamplingParams
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(**engine_args(a)))
        self.params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed=1)

    def run(self, prompts: list[list[int]], threads: int | None = None) -> dict[str, Any]:
        import torch

        engine = self.engine
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            for p in prompts:
                engine.add_request(p, self.params)
            tokens = steps = 0
            while engine.has_unfinished_requests():
                result = engine.step()
                steps += result.event is not None
                tokens += sum(len(o.new_token_ids) for o in result.outputs)
            wall = time.perf_counter() - t0
        finally:
            torch.set_num_threads(before)
        return {"wall": wall, "tokens": tokens, "steps": steps, "threads": threads or before}


MODES = {"thread": ["--engine-in-thread"], "process": []}  # server mode -> extra flags


def start_server(a: argparse.Namespace, mode: str) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "engine", "--model", a.model, "--port", "0",
        "--token-budget", str(a.token_budget), "--max-model-len", str(a.max_model_len),
        "--device", a.device, "--dtype", a.dtype, "--no-prefix-caching", "--seed", "0",
        "--log-level", "warning", *MODES[mode],
    ]  # fmt: skip
    return start_engine_server(cmd)


def stop_server(proc: subprocess.Popen[str]) -> float:
    """SIGINT, as a user would; the seconds it took to exit (engine core included)."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    return time.perf_counter() - t0


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], a: Any) -> dict:
    body = {
        "model": a.model,
        "prompt": prompt,
        "max_tokens": a.output_len,
        "ignore_eos": True,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    recv: list[float] = []
    ext: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:  # one SSE line at a time
            if not raw.startswith(b"data: {"):
                continue
            now = time.time()
            if b'"usage"' in raw:
                chunk = json.loads(raw[6:])
                usage = chunk["usage"]
                ext = chunk.get("chunkscope", {})
            else:
                recv.append(now)
    return {"recv": recv, "token_times": ext.get("token_times", []), "usage": usage}


async def _http_pass(url: str, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    connector = aiohttp.TCPConnector(limit=len(prompts) + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, p, a) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def summarize_http(best: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    results = best["results"]
    added: list[float] = []
    mismatched = 0
    for r in results:
        if len(r["recv"]) != len(r["token_times"]):
            mismatched += 1
            continue
        added += [rv - tt for rv, tt in zip(r["recv"], r["token_times"], strict=True)]
    added.sort()

    def pct(q: float) -> float:
        return added[min(len(added) - 1, int(q * (len(added) - 1)))] * 1e3 if added else 0.0

    return {
        "all_lengths_correct": all(
            r["usage"].get("completion_tokens") == a.output_len == len(r["recv"]) for r in results
        ),
        "requests_with_chunk_token_mismatch": mismatched,
        "added_latency_per_token_ms": {
            "n": len(added),
            "mean": statistics.fmean(added) * 1e3 if added else 0.0,
            "p50": pct(0.5),
            "p90": pct(0.9),
            "p99": pct(0.99),
            "max": added[-1] * 1e3 if added else 0.0,
        },
    }


def _tps(runs: list[dict[str, Any]]) -> list[float]:
    return [r["tokens"] / r["wall"] for r in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="tiny,demo",
        help="comma-separated presets; each runs the whole comparison (tiny: Python-bound "
        "worst case; demo: a forward pass that dominates the step, as on real models)",
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    add_common_args(p)
    args = p.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.models, args.num_requests, args.output_len, args.repeats = "tiny", 8, 16, 1
    if args.threads is not None:  # the servers' engine cores run in child processes
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    runs = []
    for model in args.models.split(","):
        a = argparse.Namespace(**vars(args), model=model.strip())
        print(f"== {a.model}")
        runs.append(compare(a))
    write_json(
        out_dir / "server_throughput.json",
        {"benchmark": "server_throughput", "runs": runs, "target_ratio": 0.9},
        script="bench_server.py",
        config=config_of(args),
    )
    return 0


def compare(a: argparse.Namespace) -> dict[str, Any]:
    """Offline vs HTTP (both server modes) for one model; interleaved passes."""
    prompts = workload(a.num_requests, a.prompt_len, a.seed)
    warm = prompts[: max(2, len(prompts) // 4)]
    load_before = os.getloadavg()[0]
    offline = Offline(a)
    offline.run(warm)
    # the servers' engine cores step with every CPU but one (engine.process.transport)
    from engine.process.transport import default_core_threads

    core_threads = default_core_threads()
    offline.run(warm, core_threads)
    servers: dict[str, tuple[subprocess.Popen[str], str]] = {}
    off_runs: list[dict[str, Any]] = []
    same_runs: list[dict[str, Any]] = []
    http_runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    stop_seconds: dict[str, float] = {}
    try:
        for mode in MODES:
            servers[mode] = start_server(a, mode)
            asyncio.run(_http_pass(servers[mode][1], warm, a))
        for _ in range(a.repeats):  # interleaved, so background load hits every side alike
            off_runs.append(offline.run(prompts))
            same_runs.append(offline.run(prompts, core_threads))
            for mode, (_, url) in servers.items():
                h = asyncio.run(_http_pass(url, prompts, a))
                h["tokens"] = sum(r["usage"].get("completion_tokens", 0) for r in h["results"])
                http_runs[mode].append(h)
    finally:
        for mode, (proc, _) in servers.items():
            stop_seconds[mode] = stop_server(proc)
    off_tps = _tps(off_runs)
    off = {
        "tokens_per_s_best": max(off_tps),
        "tokens_per_s_median": statistics.median(off_tps),
        "all_runs_tokens_per_s": off_tps,
        "output_tokens": off_runs[0]["tokens"],
        "steps": off_runs[0]["steps"],
    }
    same_tps = _tps(same_runs)
    same = {
        "threads": core_threads,
        "tokens_per_s_best": max(same_tps),
        "tokens_per_s_median": statistics.median(same_tps),
        "all_runs_tokens_per_s": same_tps,
    }
    off["threads"] = off_runs[0]["threads"]
    print(f"offline: best {off['tokens_per_s_best']:.0f} tok/s, "
          f"median {off['tokens_per_s_median']:.0f} ({off['threads']} threads); "
          f"at the core's {core_threads}: best {same['tokens_per_s_best']:.0f}, "
          f"median {same['tokens_per_s_median']:.0f}")  # fmt: skip
    modes = {
        mode: summarize_mode(mode, runs, off, same, stop_seconds[mode], a)
        for mode, runs in http_runs.items()
    }
    return {
        "model": a.model,
        "engine_config": engine_args(a),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "offline": off,
        "offline_core_threads": same,
        "http": modes,
        "http_over_offline": {m: r["http_over_offline"] for m, r in modes.items()},
        "http_over_offline_median": {m: r["http_over_offline_median"] for m, r in modes.items()},
        "http_over_offline_same_threads_median": {
            m: r["http_over_offline_same_threads_median"] for m, r in modes.items()
        },
        "meets_target": {m: r["meets_target"] for m, r in modes.items()},
    }


def summarize_mode(
    mode: str,
    runs: list[dict[str, Any]],
    off: dict[str, Any],
    same: dict[str, Any],
    stop_seconds: float,
    a: argparse.Namespace,
) -> dict[str, Any]:
    tps = _tps(runs)
    best = max(runs, key=lambda r: r["tokens"] / r["wall"])
    ratio = max(tps) / off["tokens_per_s_best"]
    ratio_median = statistics.median(tps) / off["tokens_per_s_median"]
    same_best = max(tps) / same["tokens_per_s_best"]
    same_median = statistics.median(tps) / same["tokens_per_s_median"]
    summary = {
        "server_flags": MODES[mode],
        "tokens_per_s_best": max(tps),
        "tokens_per_s_median": statistics.median(tps),
        "all_runs_tokens_per_s": tps,
        "output_tokens": best["tokens"],
        **summarize_http(best, a),
        "http_over_offline": ratio,
        "http_over_offline_median": ratio_median,
        "http_over_offline_same_threads": same_best,
        "http_over_offline_same_threads_median": same_median,
        "meets_target": ratio >= 0.9,
        "shutdown_seconds": stop_seconds,
    }
    lat = summary["added_latency_per_token_ms"]
    print(
        f"http {mode:7s}: best {max(tps):.0f} tok/s, median {statistics.median(tps):.0f}; "
        f"ratio best {ratio:.3f}, median {ratio_median:.3f} (same threads: best "
        f"{same_best:.3f}, median {same_median:.3f}); added latency per token: "
        f"mean {lat['mean']:.2f} ms, p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"
    )
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
