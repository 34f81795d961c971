"""Does the long-prefill cap give chat its TTFT back at a small budget? Served path, one run.

One engine (``python -m engine``, the CPU ``demo`` preset) serves open-loop chat (Poisson
arrivals: users do not wait for each other; short prompts, short answers) plus a long RAG prompt
every few seconds. Without a restart the scheduler changes live (``PUT /v1/scheduler``): per
budget, windows with the cap off (``long_prefill_token_threshold`` 0) and on alternate
(off, on, off, on, ...), so load from other processes hits both arms. An optional reference
arm at budget 16384 (a RAG prompt prefills in one step) gives the chat TTFT a big budget buys.

Measured by the client (aiohttp; one SSE chunk is one token, even with empty text), per window:
a request belongs to the window it was sent in, a gap to the window of its earlier token.
Per arm (windows of the same budget and cap pooled): chat TTFT p50/p99/max, chat ITL
p50/p99/p99.9/max, RAG TTFT p50, output tokens/s; then cap-on / cap-off ratios per budget. The
1-minute load average is recorded per window.

Run from the repo root:  .venv/bin/python -m benchmarks.cap [--quick]
Writes benchmarks/results/cap.json (--quick: the tiny preset, 2-second windows, short prompts,
results to a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
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
from benchmarks.stall_story.measure import stream_completion
from benchmarks.stall_story.workload import ClientRequest

SCRIPT = "cap.py"
CAP_KEY = "long_prefill_token_threshold"
logger = logging.getLogger("cap")


@dataclass(frozen=True)
class Window:
    budget: int
    cap: int
    index: int  # its place in the run

    @property
    def arm(self) -> str:
        return f"{self.budget}/{self.cap}"


def plan_windows(budgets: list[int], caps: list[int], pairs: int, reference: int | None) -> list:
    """Per budget, ``pairs`` rounds of one window per cap (the order of the caps reversed every
    other round, so neither arm always comes first; a cap at or above the budget cuts nothing
    and is left out there); the reference budget (cap off) last."""
    out: list[Window] = []
    for b in budgets:
        useful = [c for c in caps if c < b]
        for k in range(pairs):
            for c in useful if k % 2 == 0 else list(reversed(useful)):
                out.append(Window(b, c, len(out)))
    if reference is not None:
        for _ in range(pairs):
            out.append(Window(reference, 0, len(out)))
    return out


class Prompts:
    """Seeded random byte prompts after BOS (no prefix-cache hits)."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def make(self, n: int) -> list[int]:
        with self._lock:
            return [256] + [self._rng.randrange(256) for _ in range(n - 1)]

    def length(self, lo: int, hi: int) -> int:
        with self._lock:
            return self._rng.randint(lo, hi)


async def drive(args: argparse.Namespace, url: str, windows: list[Window]) -> dict[str, Any]:
    """Open-loop chat and periodic RAG for the whole run; the windows' changes on the way."""
    import aiohttp

    prompts = Prompts(args.seed)
    arrivals = random.Random(args.seed + 1)
    tasks: list[asyncio.Future[ClientRequest]] = []
    spans: list[dict[str, Any]] = []
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        def send(cls: str, n: int, out: int) -> None:
            prompt = prompts.make(n)
            tasks.append(
                asyncio.ensure_future(
                    stream_completion(session, url, args.preset, prompt, out, cls)
                )
            )

        async def chat() -> None:
            next_t = time.monotonic()
            while not stop.is_set():
                send("chat", prompts.length(args.chat_min, args.chat_max), args.chat_output)
                next_t += arrivals.expovariate(args.chat_rate)
                await asyncio.sleep(max(0.0, next_t - time.monotonic()))

        async def rag() -> None:
            next_t = time.monotonic() + args.rag_every / 2
            await asyncio.sleep(args.rag_every / 2)
            while not stop.is_set():
                send("rag", prompts.length(args.rag_min, args.rag_max), args.rag_output)
                next_t += args.rag_every
                await asyncio.sleep(max(0.0, next_t - time.monotonic()))

        async def put(changes: dict[str, Any]) -> dict[str, Any]:
            async with session.put(f"{url}/v1/scheduler", json=changes) as resp:
                reply = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"PUT /v1/scheduler {changes}: {resp.status} {reply}")
                return dict(reply)

        await put({"token_budget": windows[0].budget, CAP_KEY: windows[0].cap})
        workers = [asyncio.ensure_future(chat()), asyncio.ensure_future(rag())]
        await asyncio.sleep(args.warmup_s)
        for w in windows:
            reply = await put({"token_budget": w.budget, CAP_KEY: w.cap})
            start = time.time()
            await asyncio.sleep(args.window_s)
            async with session.get(f"{url}/v1/scheduler") as resp:
                state = await resp.json()
            spans.append(
                {
                    "index": w.index,
                    "budget": w.budget,
                    "cap": w.cap,
                    "start": start,
                    "end": time.time(),
                    "applied_at_step": reply.get("applied_at_step"),
                    "in_force": {k: reply.get(k) for k in ("token_budget", CAP_KEY)},
                    "loadavg_1m": os.getloadavg()[0],
                    # a queue that grows from window to window: the engine cannot keep up
                    "num_running_at_end": state.get("num_running"),
                    "num_waiting_at_end": state.get("num_waiting"),
                }
            )
            logger.warning(
                "window %d budget %d cap %d done (load %.2f, running %s, waiting %s)",
                w.index,
                w.budget,
                w.cap,
                spans[-1]["loadavg_1m"],
                state.get("num_running"),
                state.get("num_waiting"),
            )
        stop.set()
        await asyncio.gather(*workers)
        # requests still in flight get drain_s to finish, then are cut (counted as unfinished)
        _, pending = await asyncio.wait(tasks, timeout=args.drain_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        done = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
    return {"requests": done, "windows": spans, "unfinished_at_end": len(pending)}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def arm_figures(requests: list[ClientRequest], spans: list[tuple[float, float]]) -> dict:
    """Client figures over the windows ``spans`` (start, end) pooled: a request counts where it
    was sent, a gap where its earlier token falls, a token where it arrived (milliseconds)."""

    def inside(t: float) -> bool:
        return any(a <= t < b for a, b in spans)

    seconds = sum(b - a for a, b in spans)
    ttft: dict[str, list[float]] = {"chat": [], "rag": []}
    gaps: list[float] = []
    tokens = errors = 0
    for r in requests:
        if r.error:
            errors += inside(r.sent)
            continue
        t = r.chunk_times
        if t and inside(r.sent):
            ttft[r.traffic_class].append((t[0] - r.sent) * 1e3)
        tokens += sum(1 for x in t if inside(x))
        if r.traffic_class == "chat":
            gaps += [(t[k] - t[k - 1]) * 1e3 for k in range(1, len(t)) if inside(t[k - 1])]
    return {
        "seconds": seconds,
        "num_chat": len(ttft["chat"]),
        "num_rag": len(ttft["rag"]),
        "errors": errors,
        "chat_ttft_p50_ms": _pct(ttft["chat"], 50),
        "chat_ttft_p99_ms": _pct(ttft["chat"], 99),
        "chat_ttft_max_ms": max(ttft["chat"]) if ttft["chat"] else None,
        "chat_itl_p50_ms": _pct(gaps, 50),
        "chat_itl_p99_ms": _pct(gaps, 99),
        "chat_itl_p999_ms": _pct(gaps, 99.9),
        "chat_itl_max_ms": max(gaps) if gaps else None,
        "rag_ttft_p50_ms": _pct(ttft["rag"], 50),
        "rag_ttft_max_ms": max(ttft["rag"]) if ttft["rag"] else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


RATIO_KEYS = (
    "chat_ttft_p50_ms",
    "chat_ttft_p99_ms",
    "chat_itl_p99_ms",
    "chat_itl_max_ms",
    "rag_ttft_p50_ms",
    "tokens_per_s",
)


def analyse(served: dict[str, Any]) -> dict[str, Any]:
    """Figures per arm (budget, cap), per window, and cap-on / cap-off ratios per budget."""
    reqs: list[ClientRequest] = served["requests"]
    by_arm: dict[tuple[int, int], list[tuple[float, float]]] = {}
    per_window = []
    for w in served["windows"]:
        span = (w["start"], w["end"])
        by_arm.setdefault((w["budget"], w["cap"]), []).append(span)
        per_window.append({**w, **arm_figures(reqs, [span])})
    arms = [
        {"budget": b, "cap": c, "windows": len(s), **arm_figures(reqs, s)}
        for (b, c), s in by_arm.items()
    ]
    ratios = []
    for a in arms:
        if a["cap"] == 0:
            continue
        off = next((x for x in arms if x["budget"] == a["budget"] and x["cap"] == 0), None)
        if off is None:
            continue
        row: dict[str, Any] = {"budget": a["budget"], "cap": a["cap"]}
        for k in RATIO_KEYS:
            on_v, off_v = a.get(k), off.get(k)
            row[k] = on_v / off_v if on_v is not None and off_v else None
        ratios.append(row)
    return {"arms": arms, "ratios": ratios, "windows": per_window}


def markdown(result: dict[str, Any]) -> str:
    head = (
        "| budget | cap | chat TTFT p50 / p99 / max (ms) | chat ITL p50 / p99 / p99.9 / max (ms) "
        "| RAG TTFT p50 (ms) | tokens/s |"
    )
    lines = [head, "|" + "---|" * 6]

    def f(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    for a in result["arms"]:
        lines.append(
            f"| {a['budget']} | {a['cap'] or 'off'} | {f(a['chat_ttft_p50_ms'])} / "
            f"{f(a['chat_ttft_p99_ms'])} / {f(a['chat_ttft_max_ms'])} | "
            f"{f(a['chat_itl_p50_ms'])} / {f(a['chat_itl_p99_ms'])} / "
            f"{f(a['chat_itl_p999_ms'])} / {f(a['chat_itl_max_ms'])} | "
            f"{f(a['rag_ttft_p50_ms'])} | {a['tokens_per_s'] or 0:.1f} |"
        )
    return "\n".join(lines)


def run_served(args: argparse.Namespace, windows: list[Window]) -> dict[str, Any]:
    top = max([w.budget for w in windows] + [w.cap for w in windows])
    cmd = [
        sys.executable, "-m", "engine", "--model", args.preset, "--port", "0",
        "--device", "cpu", "--dtype", "float32",
        "--token-budget", str(windows[0].budget), "--max-token-budget", str(top),
        "--max-model-len", str(args.max_model_len), "--kv-blocks", str(args.kv_blocks),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc, url = start_engine_server(cmd, env=env, timeout=300, stdout=subprocess.DEVNULL)
    try:
        return asyncio.run(drive(args, url, windows))
    finally:
        stop_engine_server(proc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--budgets", default="512,256,2048", help="budgets, in this order")
    ap.add_argument("--caps", default="0,256", help="caps alternated at each budget (0: off)")
    ap.add_argument("--pairs", type=int, default=2, help="windows per (budget, cap)")
    ap.add_argument("--reference-budget", type=int, default=16384, help="0: no reference arm")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--drain-s", type=float, default=60.0, help="then in-flight requests are cut")
    ap.add_argument("--chat-rate", type=float, default=1.0, help="chat arrivals per second")
    ap.add_argument("--chat-min", type=int, default=64)
    ap.add_argument("--chat-max", type=int, default=256)
    ap.add_argument("--chat-output", type=int, default=16)
    ap.add_argument("--rag-min", type=int, default=4000)
    ap.add_argument("--rag-max", type=int, default=6000)
    ap.add_argument("--rag-every", type=float, default=6.0)
    ap.add_argument("--rag-output", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=8448)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.budgets, args.caps, args.reference_budget = "tiny", "64", "0,16", 0
        args.window_s, args.warmup_s, args.chat_rate, args.drain_s = 2.0, 1.0, 4.0, 20.0
        args.chat_min, args.chat_max, args.chat_output = 8, 24, 6
        args.rag_min, args.rag_max, args.rag_every, args.rag_output = 300, 400, 1.0, 2
        args.max_model_len, args.kv_blocks = 512, 512
    out_dir = setup(args)
    budgets = [int(x) for x in args.budgets.split(",")]
    caps = [int(x) for x in args.caps.split(",")]
    windows = plan_windows(budgets, caps, args.pairs, args.reference_budget or None)
    load_before = os.getloadavg()
    t0 = time.time()
    served = run_served(args, windows)
    result = analyse(served)
    print(markdown(result))
    for r in result["ratios"]:
        print(
            f"budget {r['budget']} cap {r['cap']} / off: "
            + ", ".join(f"{k} x{v:.2f}" for k, v in r.items() if isinstance(v, float))
        )
    write_json(
        out_dir / "cap.json",
        {
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "wall_s": time.time() - t0,
            "num_requests": len(served["requests"]),
            "unfinished_at_end": served["unfinished_at_end"],
            **result,
        },
        script=SCRIPT,
        config=config_of(args),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
