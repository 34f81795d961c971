"""HTTP streaming vs offline throughput on the same workload, and added latency per token.

The same seeded workload (N requests x P prompt tokens x O output tokens, ignore_eos) runs

  offline  through ``LLMEngine`` directly (all requests added, ``step()`` until done), and
  http     through ``python -m engine`` in a subprocess (its own GIL), driven by N concurrent
           streaming clients (``/v1/completions``, ``stream_options.include_usage``).

Throughput is output tokens / wall time (first request sent to last token received). Added
latency per streamed token is (client receive time of the chunk) - (engine token time from the
``chunkscope.token_times`` extension), both wall clock on the same machine. Each side runs a
warm-up pass first; the measured pass is repeated ``--repeats`` times and the best is kept.

Run from the repo root:  .venv/bin/python benchmarks/bench_server.py [--model tiny]
Writes benchmarks/results/server_throughput.json (configuration and machine included).
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _common import REPO_ROOT, RESULTS_DIR, machine_info, random_prompt, write_json  # noqa: E402

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


def run_offline(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(**engine_args(a)))
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed=1)

    def once(ps: list[list[int]]) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        for p in ps:
            engine.add_request(p, params)
        tokens = steps = 0
        while engine.has_unfinished_requests():
            result = engine.step()
            steps += result.event is not None
            tokens += sum(len(o.new_token_ids) for o in result.outputs)
        return time.perf_counter() - t0, tokens, steps

    once(prompts[: max(2, len(prompts) // 4)])  # warm-up
    runs = [once(prompts) for _ in range(a.repeats)]
    wall, tokens, steps = min(runs)
    return {
        "wall_s": wall,
        "output_tokens": tokens,
        "steps": steps,
        "tokens_per_s": tokens / wall,
        "all_runs_tokens_per_s": [t / w for w, t, _ in runs],
    }


def start_server(a: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [
        sys.executable, "-m", "engine", "--model", a.model, "--port", "0",
        "--token-budget", str(a.token_budget), "--max-model-len", str(a.max_model_len),
        "--device", a.device, "--dtype", a.dtype, "--no-prefix-caching", "--seed", "0",
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith("chunkscope engine listening on "):
            return proc, line.strip().rsplit(" ", 1)[-1]
    proc.kill()
    raise RuntimeError("the server did not start")


async def _one(client: httpx.AsyncClient, prompt: list[int], a: argparse.Namespace) -> dict:
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
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.time()
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                recv.append(now)
            if "usage" in chunk and chunk["usage"]:
                usage = chunk["usage"]
                ext = chunk.get("chunkscope", {})
    return {"recv": recv, "token_times": ext.get("token_times", []), "usage": usage}


async def _http_pass(url: str, prompts: list[list[int]], a: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, p, a) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def run_http(a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    proc, url = start_server(a)
    try:
        asyncio.run(_http_pass(url, prompts[: max(2, len(prompts) // 4)], a))  # warm-up
        passes = [asyncio.run(_http_pass(url, prompts, a)) for _ in range(a.repeats)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    best = min(passes, key=lambda p: p["wall"])
    results = best["results"]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in results)
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
        "wall_s": best["wall"],
        "output_tokens": tokens,
        "tokens_per_s": tokens / best["wall"],
        "all_runs_tokens_per_s": [
            sum(r["usage"].get("completion_tokens", 0) for r in p["results"]) / p["wall"]
            for p in passes
        ],
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "server_throughput.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    prompts = workload(a.num_requests, a.prompt_len, a.seed)
    offline = run_offline(a, prompts)
    print(f"offline: {offline['tokens_per_s']:.0f} tok/s ({offline['wall_s']:.2f} s)")
    http = run_http(a, prompts)
    ratio = http["tokens_per_s"] / offline["tokens_per_s"]
    lat = http["added_latency_per_token_ms"]
    print(f"http:    {http['tokens_per_s']:.0f} tok/s ({http['wall_s']:.2f} s)  ratio {ratio:.3f}")
    print(f"added latency per token: mean {lat['mean']:.2f} ms, p50 {lat['p50']:.2f} ms, "
          f"p99 {lat['p99']:.2f} ms")  # fmt: skip
    write_json(
        a.out,
        {
            "benchmark": "server_throughput",
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
            "engine_config": engine_args(a),
            "machine": machine_info(),
            "offline": offline,
            "http": http,
            "http_over_offline": ratio,
            "target_ratio": 0.9,
            "meets_target": ratio >= 0.9,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
