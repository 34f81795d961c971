"""The story, measured: chat TPOT spikes vanish when the token budget drops, on the served path.

One engine (``python -m engine``, the CPU ``demo`` preset) serves steady chat streams plus long
RAG prompts. Without a restart the scheduler changes live (``PUT /v1/scheduler``): a window at
budget 16384 (a RAG prompt prefills in one step: every chat waits for it), then 512, then 256,
then the ``unchunked`` policy (at 256: the spike comes back). Each window is measured twice:

  client  SSE chunk arrival times in this process (aiohttp, one chunk per token);
  engine  the engine's own events, streamed by its telemetry publisher into a collector
          (``python -m storage``) on a temporary SQLite file and read back with
          ``storage.queries`` after the run.

Per window: chat ITL p50/p99/p99.9/max, chat TPOT p50/p99, RAG TTFT p50/p99, chat TTFT p50/p99
and output tokens/s.

Before the served run the same traffic runs in this process on ``LLMEngine`` (same preset, same
windows): its steps fit a step cost model (``engine.core.cost_model``) per window and step kind
(decode-only, with prefill), and every served step's duration (from the store) is divided by
that model's prediction: served/predicted p50 and p95, next to the in-process steps' own
ratio to the fit. With ``CHUNKSCOPE_STEP_TRACE`` the core also records, per step, its CPU time,
its threads' run-queue wait and GC time (``engine/process/steptrace.py``); both runs report
them, so a slow served step can be told apart from a descheduled one.

Run from the repo root:  .venv/bin/python -m benchmarks.stall [--quick]
Writes benchmarks/results/stall.json and stall.png (--quick: the tiny preset, short windows,
short prompts, results to a temporary folder).

The parts live in ``benchmarks/stall_story/``: ``workload.py`` (windows, traffic),
``measure.py`` (the in-process and served runs), ``analysis.py`` (the figures) and ``report.py``
(the picture and the table); this script ties them into one run.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import (
    add_common_args,
    config_of,
    contention_probe,
    setup,
    write_json,
)
from benchmarks.stall_story.analysis import (
    client_windows,
    cost_comparison,
    engine_windows,
    inproc_windows,
    step_kind,
    trace_summary,
    wait_by_step,
    works_from_events,
    works_from_store,
)
from benchmarks.stall_story.measure import run_in_process, run_served
from benchmarks.stall_story.report import markdown_table, plot, print_table, targets
from benchmarks.stall_story.workload import ClientRequest, Traffic, windows_of

# what tests/benchmarks/test_stall.py reads through this script
__all__ = [
    "ClientRequest",
    "Traffic",
    "client_windows",
    "main",
    "markdown_table",
    "targets",
    "windows_of",
]

SCRIPT = "stall.py"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--windows", default="16384,512,256,unchunked")
    ap.add_argument("--window-s", type=float, default=24.0, help="seconds per served window")
    ap.add_argument("--inproc-window-s", type=float, default=16.0, help="in-process window")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument(
        "--turnaround-ms",
        type=float,
        default=3.0,
        help="in-process reference: a chat stream's next request arrives this long after its "
        "last token (an HTTP client's round trip), so steps have the served path's shapes",
    )
    ap.add_argument("--chat-streams", type=int, default=6)
    ap.add_argument("--chat-prompt", type=int, default=200)
    ap.add_argument("--chat-output", type=int, default=64)
    ap.add_argument("--rag-min", type=int, default=6000)
    ap.add_argument("--rag-max", type=int, default=8000)
    ap.add_argument("--rag-every", type=float, default=8.0)
    ap.add_argument("--rag-output", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8448)
    ap.add_argument("--max-token-budget", type=int, default=16384)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-trace", dest="trace", action="store_false", help="no per-step /proc trace"
    )
    ap.add_argument("--no-inprocess", dest="inprocess", action="store_false")
    ap.add_argument("--keep-raw", type=Path, default=None, help="pickle the raw run here")
    ap.add_argument(
        "--from-raw", type=Path, default=None, help="analyse a --keep-raw pickle, run nothing"
    )
    ap.add_argument(
        "--core-threads",
        type=int,
        default=None,
        help="the engine core's --cpu-threads (default: the server's own default, every CPU but "
        "one); the in-process reference steps with the same number",
    )
    return ap


QUICK = {
    "preset": "tiny",
    "window_s": 3.0,
    "inproc_window_s": 3.0,
    "warmup_s": 1.5,
    "rag_min": 1500,
    "rag_max": 2000,
    "rag_every": 1.0,
    "chat_output": 32,
}


def apply_quick(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--quick shrinks what the command line left at its default."""
    for key, value in QUICK.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(args, parser)
    from engine.process.transport import default_core_threads

    core_threads = args.core_threads or default_core_threads()
    out_dir = setup(args)
    windows = windows_of(args.windows)
    before = contention_probe()

    def traffic(window_s: float) -> Traffic:
        return Traffic(
            args.chat_streams,
            args.chat_prompt,
            args.chat_output,
            args.rag_min,
            args.rag_max,
            args.rag_every,
            args.rag_output,
            args.seed,
            rag_cycle=max(1, round(window_s / args.rag_every)),
        )

    if args.from_raw is not None:  # re-analyse a kept run
        with open(args.from_raw, "rb") as f:
            inproc, served, before, after = pickle.load(f)
    else:
        inproc = (
            run_in_process(args, traffic(args.inproc_window_s), windows, core_threads)
            if args.inprocess
            else None
        )
        with tempfile.TemporaryDirectory(prefix="chunkscope-stall-") as tmp:
            served = run_served(args, traffic(args.window_s), windows, Path(tmp))
        after = contention_probe()
    if args.keep_raw is not None:
        with open(args.keep_raw, "wb") as f:
            pickle.dump((inproc, served, before, after), f)
    store = served["store"]
    # window bounds: the start of the step each change applied at (engine clock, wall seconds)
    steps = store["steps"]
    step_start = steps.set_index("step")["start"]
    applied = []
    for ch in served["changes"]:
        at = int(ch["reply"]["applied_at_step"])
        applied.append((ch["label"], at, float(step_start.get(at, ch["time"]))))
    bounds = [
        (label, t, applied[i + 1][2] if i + 1 < len(applied) else served["end"])
        for i, (label, _, t) in enumerate(applied)
    ]
    step_bounds = {
        label: (at, applied[i + 1][1] if i + 1 < len(applied) else 10**12)
        for i, (label, at, _) in enumerate(applied)
    }
    client_rows = client_windows(served, bounds)
    engine_rows = engine_windows(store, bounds)
    engines = store["engines"]
    served_config = engines.iloc[-1]["config"] if len(engines) else None
    if isinstance(served_config, str):
        served_config = json.loads(served_config)
    result: dict[str, Any] = {
        "served_engine_config": served_config,
        "inproc_cpu_threads": core_threads if args.inprocess else None,
        "contention_before": before,
        "contention_after": after,
        "windows": [
            {
                "window": label,
                "start": lo,
                "seconds": hi - lo,
                "applied_at_step": step_bounds[label][0],
            }
            for label, lo, hi in bounds
        ],
        "client": client_rows,
        "engine": engine_rows,
        "process_cpu": served["cpu"],
        "requests": {
            "sent": len(served["requests"]),
            "errors": sum(1 for r in served["requests"] if r.error),
            "first_errors": [r.error for r in served["requests"] if r.error][:5],
        },
    }
    works = works_from_store(store["chunks"]) if store["chunks"] is not None else {}
    served_kinds = {s: step_kind(w) for s, w in works.items()}
    if "trace" in served:
        result["served_trace"] = trace_summary(served["trace"], served_kinds)
    if inproc is not None:
        result["cost_model"] = cost_comparison(inproc, store, step_bounds)
        if "trace" in served:
            result["cost_model_minus_cpu_wait"] = cost_comparison(
                inproc,
                store,
                step_bounds,
                inproc_wait=wait_by_step(inproc["trace"]),
                served_wait=wait_by_step(served["trace"]),
            )
        ip_kinds = {
            e.step: step_kind(w)
            for e, w in zip(inproc["steps"], works_from_events(inproc["steps"]), strict=True)
        }
        result["inproc_trace"] = trace_summary(inproc["trace"], ip_kinds)
        result["inproc_engine"] = inproc_windows(inproc)
    result["targets"] = targets(client_rows, engine_rows)
    name = "stall"
    write_json(out_dir / f"{name}.json", result, script=SCRIPT, config=config_of(args))
    load = f"load {before['loadavg_1m']:.1f}/{after['loadavg_1m']:.1f}"
    plot(
        out_dir / f"{name}.png",
        served,
        bounds,
        f"chunkscope served, preset {args.preset}: {args.chat_streams} chat streams + a "
        f"{args.rag_min:,}-{args.rag_max:,}-token RAG prompt every {args.rag_every:g} s; "
        f"budget changed live ({load})",
        client_rows,
    )
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
