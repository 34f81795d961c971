"""HTTP streaming vs offline throughput on the same workload, and added latency per token.

The same seeded workload (N requests x P prompt tokens x O output tokens, ignore_eos) runs

  offline  through ``LLMEngine`` directly (all requests added, ``step()`` until done), and
  http     through ``python -m engine`` in a subprocess (its own GIL), driven by N concurrent
           streaming aiohttp clients (``/v1/completions``, ``stream_options.include_usage``).

Throughput is output tokens / wall time (first request sent to last token received). Added
latency per streamed token is (client receive time of the chunk) - (engine token time from the
``chunkscope.token_times`` extension), both wall clock on the same machine. Each side runs a
warm-up pass first; measured passes alternate offline / http ``--repeats`` times (so load from
other processes hits both alike); best and median are reported.

Run from the repo root:  .venv/bin/python benchmarks/bench_server.py [--models tiny,demo]
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

import aiohttp  # noqa: E402
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


class Offline:
    """The offline side: one engine, the workload run to completion with ``step()``."""

    def __init__(self, a: argparse.Namespace) -> None:
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams

        self.engine = LLMEngine(EngineConfig(**engine_args(a)))
        self.params = SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed=1)

    def run(self, prompts: list[list[int]]) -> dict[str, Any]:
        engine = self.engine
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(p, self.params)
        tokens = steps = 0
        while engine.has_unfinished_requests():
            result = engine.step()
            steps += result.event is not None
            tokens += sum(len(o.new_token_ids) for o in result.outputs)
        wall = time.perf_counter() - t0
        return {"wall": wall, "tokens": tokens, "steps": steps}


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
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "server_throughput.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    runs = []
    for model in args.models.split(","):
        a = argparse.Namespace(**vars(args), model=model.strip())
        print(f"== {a.model}")
        runs.append(compare(a))
    write_json(
        args.out,
        {
            "benchmark": "server_throughput",
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": machine_info(),
            "runs": runs,
            "target_ratio": 0.9,
        },
    )
    return 0


def compare(a: argparse.Namespace) -> dict[str, Any]:
    """Offline vs HTTP for one model; interleaved passes."""
    prompts = workload(a.num_requests, a.prompt_len, a.seed)
    warm = prompts[: max(2, len(prompts) // 4)]
    offline = Offline(a)
    offline.run(warm)
    proc, url = start_server(a)
    off_runs: list[dict[str, Any]] = []
    http_runs: list[dict[str, Any]] = []
    try:
        asyncio.run(_http_pass(url, warm, a))
        for _ in range(a.repeats):  # interleaved, so background load hits both sides alike
            off_runs.append(offline.run(prompts))
            h = asyncio.run(_http_pass(url, prompts, a))
            h["tokens"] = sum(r["usage"].get("completion_tokens", 0) for r in h["results"])
            http_runs.append(h)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    off_tps, http_tps = _tps(off_runs), _tps(http_runs)
    best_http = max(http_runs, key=lambda r: r["tokens"] / r["wall"])
    http = {
        "tokens_per_s_best": max(http_tps),
        "tokens_per_s_median": statistics.median(http_tps),
        "all_runs_tokens_per_s": http_tps,
        "output_tokens": best_http["tokens"],
        **summarize_http(best_http, a),
    }
    off = {
        "tokens_per_s_best": max(off_tps),
        "tokens_per_s_median": statistics.median(off_tps),
        "all_runs_tokens_per_s": off_tps,
        "output_tokens": off_runs[0]["tokens"],
        "steps": off_runs[0]["steps"],
    }
    ratio = http["tokens_per_s_best"] / off["tokens_per_s_best"]
    ratio_median = http["tokens_per_s_median"] / off["tokens_per_s_median"]
    lat = http["added_latency_per_token_ms"]
    print(f"offline: best {off['tokens_per_s_best']:.0f} tok/s, "
          f"median {off['tokens_per_s_median']:.0f}")  # fmt: skip
    print(f"http:    best {http['tokens_per_s_best']:.0f} tok/s, "
          f"median {http['tokens_per_s_median']:.0f}; ratio best {ratio:.3f}, "
          f"median {ratio_median:.3f}")  # fmt: skip
    print(f"added latency per token: mean {lat['mean']:.2f} ms, p50 {lat['p50']:.2f} ms, "
          f"p99 {lat['p99']:.2f} ms")  # fmt: skip
    return {
        "model": a.model,
        "engine_config": engine_args(a),
        "offline": off,
        "http": http,
        "http_over_offline": ratio,
        "http_over_offline_median": ratio_median,
        "meets_target": ratio >= 0.9,
    }


if __name__ == "__main__":
    raise SystemExit(main())
