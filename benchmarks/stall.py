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
"""

import argparse
import asyncio
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_common_args,
    config_of,
    contention_probe,
    setup,
    start_engine_server,
    write_json,
)

SCRIPT = "stall.py"
logger = logging.getLogger("stall")


# --- the workload ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    label: str
    changes: dict[str, Any]  # applied live at the window's start


def windows_of(spec: str) -> list[Window]:
    """``16384,512,256,unchunked``: a budget per window, or ``unchunked`` (the policy, at the
    budget before it)."""
    out = []
    for i, item in enumerate(s.strip() for s in spec.split(",")):
        if item == "unchunked":
            out.append(Window("unchunked", {"policy": "unchunked"}))
        else:
            changes: dict[str, Any] = {"token_budget": int(item)}
            if i == 0:
                changes["policy"] = "chunked"
            out.append(Window(item, changes))
    return out


@dataclass
class Traffic:
    """Closed-loop chat streams (a new request as soon as one ends) and RAG prompts on a fixed
    period whose lengths cycle evenly over [rag_min, rag_max] once per ``rag_cycle`` prompts (a
    window as long as a cycle sees every length, so windows are alike); every prompt is seeded
    random bytes after BOS (no prefix-cache hits)."""

    chat_streams: int
    chat_prompt: int
    chat_output: int
    rag_min: int
    rag_max: int
    rag_every: float
    rag_output: int
    seed: int
    rag_cycle: int = 1

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        n = max(1, self.rag_cycle)
        self.rag_lengths = [
            round(self.rag_max - (self.rag_max - self.rag_min) * i / max(1, n - 1))
            for i in range(n)
        ]
        self._num_rag = 0

    def prompt(self, n: int) -> list[int]:
        with self._lock:
            return [256] + [self._rng.randrange(256) for _ in range(n - 1)]

    def chat_prompt_ids(self) -> list[int]:
        return self.prompt(self.chat_prompt)

    def rag_prompt_ids(self) -> list[int]:
        with self._lock:
            n = self.rag_lengths[self._num_rag % len(self.rag_lengths)]
            self._num_rag += 1
        return self.prompt(n)


@dataclass
class ClientRequest:
    """One request as the client saw it (wall-clock seconds)."""

    traffic_class: str
    num_prompt_tokens: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    engine_token_times: list[float] = field(default_factory=list)
    error: str | None = None


# --- in-process reference -------------------------------------------------------------------------
def run_in_process(
    args: argparse.Namespace, traffic: Traffic, windows: list[Window], threads: int
) -> dict[str, Any]:
    """The same traffic on ``LLMEngine`` in this process: every step event, per window."""
    import gc

    from engine.core.config import EngineConfig
    from engine.core.sampling_params import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.process.steptrace import StepTracer

    engine = LLMEngine(
        EngineConfig(
            model=args.preset,
            token_budget=int(windows[0].changes.get("token_budget", 16384)),
            max_token_budget=args.max_token_budget,
            max_model_len=args.max_model_len,
            num_kv_blocks=args.kv_blocks,
            device="cpu",
            dtype="float32",
            seed=0,
            cpu_threads=threads,
        )
    )
    gc.collect()
    gc.freeze()
    chat_params = SamplingParams(max_tokens=traffic.chat_output, temperature=0.0, ignore_eos=True)
    rag_params = SamplingParams(max_tokens=traffic.rag_output, temperature=0.0, ignore_eos=True)
    trace_path = Path(tempfile.mkstemp(prefix="stall-inproc-", suffix=".jsonl")[1])
    tracer = StepTracer(open(trace_path, "w"))  # noqa: SIM115 - closed below
    steps: list[Any] = []
    boundaries: list[int] = []  # first step of each window
    chat_ids: set[str] = set()
    for _ in range(traffic.chat_streams):
        chat_ids.add(
            engine.add_request(traffic.chat_prompt_ids(), chat_params, traffic_class="chat")
        )
    due: list[float] = []
    next_rag = time.monotonic()
    window_s = args.inproc_window_s
    for i, w in enumerate([Window("warmup", {}), *windows]):
        if i:
            for key, value in w.changes.items():
                (engine.set_token_budget if key == "token_budget" else engine.set_policy)(value)
            boundaries.append(engine.stats().step)
        end = time.monotonic() + (args.warmup_s if i == 0 else window_s)
        while time.monotonic() < end:
            if time.monotonic() >= next_rag:
                engine.add_request(traffic.rag_prompt_ids(), rag_params, traffic_class="rag")
                next_rag += traffic.rag_every
            now = time.monotonic()
            while due and due[0] <= now:  # a client sends its next chat after its last token
                due.pop(0)
                chat_ids.add(
                    engine.add_request(traffic.chat_prompt_ids(), chat_params, traffic_class="chat")
                )
            tracer.begin()
            res = engine.step()
            tracer.end(res.event.step if res.event else None)
            if res.event is not None:
                steps.append(res.event)
            for out in res.outputs:
                if out.finished and out.request_id in chat_ids:
                    chat_ids.discard(out.request_id)
                    due.append(time.monotonic() + args.turnaround_ms / 1e3)
    tracer.close()
    gc.unfreeze()
    from engine.process.steptrace import read_trace

    trace = read_trace(trace_path)
    trace_path.unlink()
    return {
        "steps": steps,
        "boundaries": boundaries,
        "trace": trace,
        "labels": [w.label for w in windows],
    }


# --- served run -----------------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


async def _stream(
    session: Any, url: str, model: str, prompt: list[int], max_tokens: int, cls: str
) -> ClientRequest:
    rec = ClientRequest(cls, len(prompt), time.time())
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={"x-traffic-class": cls}
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return rec
            async for line in resp.content:
                now = time.time()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("choices"):
                    rec.chunk_times.append(now)
                elif "chunkscope" in obj:
                    rec.engine_token_times = list(obj["chunkscope"].get("token_times") or [])
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def _drive(
    args: argparse.Namespace,
    url: str,
    traffic: Traffic,
    windows: list[Window],
    pids: dict[str, int],
) -> dict[str, Any]:
    import aiohttp

    done: list[ClientRequest] = []
    changes: list[dict[str, Any]] = []
    cpu: list[dict[str, Any]] = []
    stop = asyncio.Event()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    model = args.preset
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def chat() -> None:
            while not stop.is_set():
                rec = await _stream(
                    session, url, model, traffic.chat_prompt_ids(), traffic.chat_output, "chat"
                )
                done.append(rec)
                if rec.error:
                    await asyncio.sleep(0.1)

        async def rag() -> None:
            tasks = []
            next_t = time.monotonic()
            while not stop.is_set():
                tasks.append(
                    asyncio.ensure_future(
                        _stream(
                            session,
                            url,
                            model,
                            traffic.rag_prompt_ids(),
                            traffic.rag_output,
                            "rag",
                        )
                    )
                )
                next_t += traffic.rag_every
                await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            for rec in await asyncio.gather(*tasks):
                done.append(rec)

        workers = [asyncio.ensure_future(chat()) for _ in range(traffic.chat_streams)]
        workers.append(asyncio.ensure_future(rag()))
        await asyncio.sleep(args.warmup_s)
        for w in windows:
            cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
            t0 = time.monotonic()
            async with session.put(f"{url}/v1/scheduler", json=w.changes) as resp:
                reply = await resp.json()
            changes.append({"label": w.label, "time": time.time(), "reply": reply})
            await asyncio.sleep(args.window_s)
            cpu1 = {name: proc_cpu_s(pid) for name, pid in pids.items()}
            elapsed = time.monotonic() - t0
            cpu.append(
                {
                    "window": w.label,
                    **{
                        f"{name}_cores": (cpu1[name] - cpu0[name]) / elapsed
                        for name in pids
                        if cpu0[name] is not None and cpu1[name] is not None
                    },
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
        end = time.time()
        stop.set()
        await asyncio.gather(*workers)
    return {"requests": done, "changes": changes, "end": end, "cpu": cpu}


def run_served(
    args: argparse.Namespace, traffic: Traffic, windows: list[Window], workdir: Path
) -> dict[str, Any]:
    from testkit.collector import start_collector

    db_url = f"sqlite:///{workdir / 'stall.db'}"
    collector = start_collector(db_url, args=["--log-level", "WARNING"])
    trace_path = workdir / "core-trace.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.trace:
        env["CHUNKSCOPE_STEP_TRACE"] = str(trace_path)
    first_budget = int(windows[0].changes.get("token_budget", 16384))
    cmd = [
        sys.executable,
        "-m",
        "engine",
        "--model",
        args.preset,
        "--port",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--token-budget",
        str(first_budget),
        "--max-token-budget",
        str(args.max_token_budget),
        "--max-model-len",
        str(args.max_model_len),
        "--kv-blocks",
        str(args.kv_blocks),
        "--collector-url",
        collector.url,
        "--log-level",
        "warning",
    ]
    if args.core_threads is not None:
        cmd += ["--cpu-threads", str(args.core_threads)]
    proc, url = start_engine_server(cmd, env=env, timeout=300, stdout=subprocess.DEVNULL)
    try:
        pids = {"server": proc.pid, "collector": collector.process.pid, "client": os.getpid()}
        for child in child_pids(proc.pid):
            pids["core"] = child
        served = asyncio.run(_drive(args, url, traffic, windows, pids))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    time.sleep(1.0)  # the collector's last commit
    served["store"] = read_store(db_url)
    collector.stop()
    logger.warning(
        "store: %d steps, %d requests; collector log tail: %s",
        len(served["store"]["steps"]),
        len(served["store"]["requests"]),
        collector.lines[-5:],
    )
    if args.trace and trace_path.exists():
        from engine.process.steptrace import read_trace

        served["trace"] = read_trace(trace_path)
    return served


def read_store(db_url: str) -> dict[str, Any]:
    """Everything the analysis needs from the collector's store, via storage.queries."""
    from storage import queries
    from storage.db import connect

    db = connect(db_url, readonly=True)
    try:
        steps = queries.steps(db)
        chunks = (
            queries.step_chunks(
                db, step_from=int(steps["step"].min()), step_to=int(steps["step"].max())
            )
            if len(steps)
            else None
        )
        return {
            "steps": steps,
            "chunks": chunks,
            "itl": queries.token_itl(db),
            "requests": queries.requests(db),
            "controls": queries.controls(db),
            "engines": queries.engines(db),
        }
    finally:
        db.dispose()


# --- analysis -------------------------------------------------------------------------------------
def pct(values: Any, q: float) -> float | None:
    a = np.asarray(values, dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(np.percentile(a, q)) if a.size else None


def latency_row(
    itl_ms: Any, tpot_ms: Any, rag_ttft_ms: Any, chat_ttft_ms: Any, tokens: int, seconds: float
) -> dict[str, Any]:
    itl = np.asarray(itl_ms, dtype=np.float64)
    return {
        "chat_itl_n": int(itl.size),
        "chat_itl_p50_ms": pct(itl, 50),
        "chat_itl_p99_ms": pct(itl, 99),
        "chat_itl_p999_ms": pct(itl, 99.9),
        "chat_itl_max_ms": float(itl.max()) if itl.size else None,
        "chat_tpot_p50_ms": pct(tpot_ms, 50),
        "chat_tpot_p99_ms": pct(tpot_ms, 99),
        "rag_ttft_n": int(np.asarray(rag_ttft_ms).size),
        "rag_ttft_p50_ms": pct(rag_ttft_ms, 50),
        "rag_ttft_p99_ms": pct(rag_ttft_ms, 99),
        "chat_ttft_p50_ms": pct(chat_ttft_ms, 50),
        "chat_ttft_p99_ms": pct(chat_ttft_ms, 99),
        "output_tokens": int(tokens),
        "output_tokens_per_s": tokens / seconds if seconds > 0 else None,
    }


def client_windows(
    served: dict[str, Any], bounds: list[tuple[str, float, float]]
) -> list[dict[str, Any]]:
    """Per window, from SSE arrival times: a gap belongs to the window its first token is in, a
    request's TPOT and TTFT to the window it was sent in, a token to the window it arrived in."""
    reqs = [r for r in served["requests"] if r.error is None and r.chunk_times]
    rows = []
    for label, lo, hi in bounds:
        itl, tpot, rag_ttft, chat_ttft, tokens, delivery = [], [], [], [], 0, []
        for r in reqs:
            t = np.asarray(r.chunk_times)
            tokens += int(((t >= lo) & (t < hi)).sum())
            if len(r.engine_token_times) == t.size:
                lag = (t - np.asarray(r.engine_token_times)) * 1e3
                delivery.extend(lag[(t >= lo) & (t < hi)].tolist())
            if r.traffic_class == "chat":
                gaps = np.diff(t) * 1e3
                # a gap belongs to the window its first token is in: the step that ends it
                # started then, under that window's budget (engine times where known)
                known = len(r.engine_token_times) == t.size
                earlier = np.asarray(r.engine_token_times)[:-1] if known else t[:-1]
                itl.extend(gaps[(earlier >= lo) & (earlier < hi)].tolist())
            if lo <= r.sent < hi:
                ttft = (t[0] - r.sent) * 1e3
                if r.traffic_class == "rag":
                    rag_ttft.append(ttft)
                else:
                    chat_ttft.append(ttft)
                    if t.size >= 2:
                        tpot.append((t[-1] - t[0]) / (t.size - 1) * 1e3)
        row = {"window": label, **latency_row(itl, tpot, rag_ttft, chat_ttft, tokens, hi - lo)}
        row["delivery_p50_ms"] = pct(delivery, 50)
        row["delivery_p99_ms"] = pct(delivery, 99)
        row["delivery_max_ms"] = float(np.max(delivery)) if delivery else None
        rows.append(row)
    return rows


def engine_windows(
    store: dict[str, Any], bounds: list[tuple[str, float, float]]
) -> list[dict[str, Any]]:
    """Per window, from the stored events (engine clock): same definitions as the client's."""
    itl = store["itl"]
    reqs = store["requests"]
    chunks = store["chunks"]
    steps = store["steps"]
    produced = (
        chunks[chunks["produced_token"]].groupby("step").size() if chunks is not None else None
    )
    step_end = steps.set_index("step")["end"]
    rows = []
    for label, lo, hi in bounds:
        earlier = itl["time"] - itl["itl_ms"] / 1e3  # as the client side: by the gap's start
        chat_itl = itl[(itl["traffic_class"] == "chat") & (earlier >= lo) & (earlier < hi)]
        sent = reqs[(reqs["arrival"] >= lo) & (reqs["arrival"] < hi)]
        chat = sent[sent["traffic_class"] == "chat"]
        rag = sent[sent["traffic_class"] == "rag"]
        tokens = 0
        if produced is not None:
            ends = step_end.reindex(produced.index)
            tokens = int(produced[(ends >= lo) & (ends < hi)].sum())
        rows.append(
            {
                "window": label,
                **latency_row(
                    chat_itl["itl_ms"],
                    chat["tpot_ms"].dropna(),
                    rag["ttft_ms"].dropna(),
                    chat["ttft_ms"].dropna(),
                    tokens,
                    hi - lo,
                ),
            }
        )
    return rows


def _works_from_events(events: list[Any]) -> list[Any]:
    from engine.core.cost_model import StepWork

    return [StepWork.from_chunks(e.chunks) for e in events]


def _works_from_store(chunks: Any) -> dict[int, Any]:
    from engine.core.cost_model import StepWork

    out = {}
    for step, group in chunks.groupby("step"):
        out[int(step)] = StepWork.from_chunks(
            group[["kind", "start", "num_tokens"]].to_dict("records")
        )
    return out


def step_kind(work: Any) -> str:
    return "decode" if work.prefill_tokens == 0 else "prefill"


def cost_comparison(
    inproc: dict[str, Any],
    store: dict[str, Any],
    served_bounds: dict[str, tuple[int, int]],
    inproc_wait: dict[int, float] | None = None,
    served_wait: dict[int, float] | None = None,
) -> dict[str, Any]:
    """Fit the cost model per (window, step kind) on in-process steps; divide each served step's
    duration by its prediction. With ``*_wait`` (step -> seconds its threads waited for a CPU,
    from the step traces) that wait is taken off every duration first: what is left is the
    step's time on a CPU, which other processes on the machine cannot stretch."""
    from engine.core.cost_model import fit

    iw = inproc_wait or {}
    sw = served_wait or {}

    events = inproc["steps"]
    works = _works_from_events(events)
    labels = inproc["labels"]
    bnd = inproc["boundaries"] + [10**12]
    models: dict[tuple[str, str], Any] = {}
    ranges: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    inproc_ratios: dict[tuple[str, str], list[float]] = {}
    for i, label in enumerate(labels):
        lo, hi = bnd[i], bnd[i + 1]
        for kind in ("decode", "prefill"):
            sel = [
                (w, max(1e-6, e.duration - iw.get(e.step, 0.0)))
                for w, e in zip(works, events, strict=True)
                if lo <= e.step < hi and step_kind(w) == kind
            ]
            if len(sel) < 8:
                continue
            model = fit([w for w, _ in sel], [t for _, t in sel])
            models[(label, kind)] = model
            rows = np.array([w.row()[1:] for w, _ in sel])
            ranges[(label, kind)] = (rows.min(axis=0), rows.max(axis=0))
            pred = model.predict_many([w for w, _ in sel])
            inproc_ratios[(label, kind)] = (np.array([t for _, t in sel]) / pred).tolist()
    served_works = _works_from_store(store["chunks"])
    steps = store["steps"].set_index("step")
    served_ratios: dict[tuple[str, str], list[float]] = {}
    served_durations: dict[tuple[str, str], list[float]] = {}
    outside: dict[tuple[str, str], int] = {}
    for label, (lo, hi) in served_bounds.items():
        for step, row in steps.loc[(steps.index >= lo) & (steps.index < hi)].iterrows():
            w = served_works.get(int(step))
            if w is None:
                continue
            key = (label, step_kind(w))
            model = models.get(key)
            if model is None:
                continue
            lo_w, hi_w = ranges[key]
            x = np.array(w.row()[1:])
            if np.any(x < lo_w) or np.any(x > hi_w):  # no in-process step like it: no prediction
                outside[key] = outside.get(key, 0) + 1
                continue
            dur = max(1e-6, row["duration_ms"] / 1e3 - sw.get(int(step), 0.0))
            served_ratios.setdefault(key, []).append(dur / max(model.predict(w), 1e-6))
            served_durations.setdefault(key, []).append(dur)
    per = []
    for key, model in models.items():
        s = np.asarray(served_ratios.get(key, []))
        r = np.asarray(inproc_ratios[key])
        per.append(
            {
                "window": key[0],
                "kind": key[1],
                "model": model.to_dict(),
                "inproc_steps": int(r.size),
                "inproc_ratio_p50": pct(r, 50),
                "inproc_ratio_p95": pct(r, 95),
                "served_steps": int(s.size),
                "served_steps_outside_fit_range": outside.get(key, 0),
                "served_ratio_p50": pct(s, 50),
                "served_ratio_p95": pct(s, 95),
                "served_ratio_max": float(s.max()) if s.size else None,
            }
        )
    all_served = np.concatenate([np.asarray(v) for v in served_ratios.values()] or [np.zeros(0)])
    all_inproc = np.concatenate([np.asarray(v) for v in inproc_ratios.values()] or [np.zeros(0)])
    prefill_served = np.concatenate(
        [np.asarray(v) for k, v in served_ratios.items() if k[1] == "prefill"] or [np.zeros(0)]
    )
    st = store["steps"].sort_values("step")
    consecutive = np.diff(st["step"].to_numpy()) == 1
    served_gap = ((st["start_ns"].to_numpy()[1:] - st["end_ns"].to_numpy()[:-1]) / 1e6)[consecutive]
    ip_gap = np.array(
        [
            (b.start_ns - a.end_ns) / 1e6
            for a, b in zip(events, events[1:], strict=False)
            if b.step == a.step + 1
        ]
    )
    return {
        "between_steps_ms": {
            "served_p50": pct(served_gap, 50),
            "served_p95": pct(served_gap, 95),
            "served_max": float(served_gap.max()) if served_gap.size else None,
            "inproc_p50": pct(ip_gap, 50),
            "inproc_p95": pct(ip_gap, 95),
            "inproc_max": float(ip_gap.max()) if ip_gap.size else None,
        },
        "per_window_kind": per,
        "served_ratio_p50": pct(all_served, 50),
        "served_ratio_p95": pct(all_served, 95),
        "served_prefill_ratio_p50": pct(prefill_served, 50),
        "served_prefill_ratio_p95": pct(prefill_served, 95),
        "inproc_ratio_p50": pct(all_inproc, 50),
        "inproc_ratio_p95": pct(all_inproc, 95),
        "served_steps": int(all_served.size),
        "served_steps_outside_fit_range": int(sum(outside.values())),
    }


def wait_by_step(trace: list[dict[str, Any]]) -> dict[int, float]:
    """Seconds each step's threads spent runnable but not running (Linux schedstat)."""
    return {r["step"]: r["runq_wait_ns"] / 1e9 for r in trace if r.get("step") is not None}


def trace_summary(trace: list[dict[str, Any]], step_kinds: dict[int, str]) -> dict[str, Any]:
    """Per step kind: how much of the step's wall time its threads waited for a CPU, its CPU
    utilisation (process CPU / wall), GC time."""
    out: dict[str, Any] = {}
    for kind in ("decode", "prefill"):
        recs = [r for r in trace if r.get("step") is not None and step_kinds.get(r["step"]) == kind]
        if not recs:
            continue
        wall = np.array([r["wall_ns"] for r in recs], dtype=np.float64)
        out[kind] = {
            "steps": len(recs),
            "wall_ms_p50": pct(wall / 1e6, 50),
            "cpu_per_wall_p50": pct(np.array([r["cpu_ns"] for r in recs]) / wall, 50),
            "runq_wait_per_wall_p50": pct(np.array([r["runq_wait_ns"] for r in recs]) / wall, 50),
            "runq_wait_per_wall_p95": pct(np.array([r["runq_wait_ns"] for r in recs]) / wall, 95),
            "nivcsw_per_step_mean": float(np.mean([r["nivcsw"] for r in recs])),
            "gc_ms_total": float(sum(r["gc_ns"] for r in recs) / 1e6),
            "gc_ms_max": float(max(r["gc_ns"] for r in recs) / 1e6),
            "gc_count": int(sum(r["gc_count"] for r in recs)),
        }
        sends = [r["send_ns"] / 1e6 for r in recs if "send_ns" in r]
        if sends:
            out[kind]["send_ms_p50"] = pct(sends, 50)
            out[kind]["send_ms_max"] = float(max(sends))
    return out


def inproc_windows(inproc: dict[str, Any]) -> list[dict[str, Any]]:
    """In-process engine-side latencies per window (token times = step end times)."""
    events = inproc["steps"]
    bnd = inproc["boundaries"] + [10**12]
    rows = []
    last: dict[str, float] = {}
    per_window_itl: dict[int, list[float]] = {}
    for e in events:
        w = next((i for i in range(len(bnd) - 1) if bnd[i] <= e.step < bnd[i + 1]), None)
        for c in e.chunks:
            if not c.produced_token:
                continue
            prev = last.get(c.request_id)
            last[c.request_id] = e.end_ns
            if prev is not None and c.kind == "decode" and w is not None and c.num_tokens == 1:
                per_window_itl.setdefault(w, []).append((e.end_ns - prev) / 1e6)
    for i, label in enumerate(inproc["labels"]):
        itl = np.asarray(per_window_itl.get(i, []))
        rows.append(
            {
                "window": label,
                "decode_gap_n": int(itl.size),
                "decode_gap_p50_ms": pct(itl, 50),
                "decode_gap_p999_ms": pct(itl, 99.9),
                "decode_gap_max_ms": float(itl.max()) if itl.size else None,
            }
        )
    return rows


# --- the picture ----------------------------------------------------------------------------------
def plot(
    path: Path,
    served: dict[str, Any],
    bounds: list[tuple[str, float, float]],
    title: str,
    client_rows: list[dict[str, Any]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = bounds[0][1]
    xs, ys = [], []
    for r in served["requests"]:
        if r.traffic_class != "chat" or r.error or len(r.chunk_times) < 2:
            continue
        t = np.asarray(r.chunk_times)
        xs.extend((t[1:] - t0).tolist())
        ys.extend((np.diff(t) * 1e3).tolist())
    rag_sent = [r.sent - t0 for r in served["requests"] if r.traffic_class == "rag"]
    fig, ax = plt.subplots(figsize=(11, 4.8), dpi=120)
    gaps = np.asarray(ys)
    tall = gaps >= 1000  # a stall: every chat stream's gap ends at once, so its dots coincide
    ax.scatter(
        np.asarray(xs)[~tall],
        gaps[~tall],
        s=4,
        alpha=0.45,
        color="#1f77b4",
        linewidths=0,
        label="chat token gap",
    )
    ax.scatter(
        np.asarray(xs)[tall],
        gaps[tall],
        s=36,
        color="#d62728",
        edgecolors="white",
        linewidths=0.5,
        label="chat token gap over 1 s",
    )
    ax.set_yscale("log")
    ax.set_xlim(-2, bounds[-1][2] - t0)
    ax.set_ylim(1, max(ys + [10]) * 6)
    ax.scatter(
        rag_sent,
        [1.25] * len(rag_sent),
        marker="^",
        s=30,
        color="#2ca02c",
        label="RAG prompt sent",
    )
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.set_xlabel("seconds since the first window")
    ax.set_ylabel("chat inter-token latency (ms, client)")
    for (label, lo, hi), row in zip(bounds, client_rows, strict=True):
        ax.axvline(lo - t0, color="#7f0000", lw=1.2)
        name = f"budget {label}" if label != "unchunked" else "policy unchunked"
        mx = row["chat_itl_max_ms"]
        ax.text(
            lo - t0 + 0.3,
            ax.get_ylim()[1] / 1.25,
            f"{name}\nmax {mx:,.0f} ms" if mx else name,
            color="#7f0000",
            fontsize=9,
            va="top",
        )
        if mx:
            ax.hlines(mx, lo - t0, hi - t0, colors="#ff7f0e", lw=1, linestyles="dashed")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------
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
    works = _works_from_store(store["chunks"]) if store["chunks"] is not None else {}
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
            for e, w in zip(inproc["steps"], _works_from_events(inproc["steps"]), strict=True)
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


def targets(client: list[dict[str, Any]], engine: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, as ratios against the first window."""
    out: dict[str, Any] = {}
    for side, rows in (("client", client), ("engine", engine)):
        base = rows[0]
        for row in rows[1:]:
            key = f"{side}_{row['window']}"
            out[key] = {
                "max_itl_reduction": _ratio(base["chat_itl_max_ms"], row["chat_itl_max_ms"]),
                "p999_itl_reduction": _ratio(base["chat_itl_p999_ms"], row["chat_itl_p999_ms"]),
                "throughput_ratio": _ratio(row["output_tokens_per_s"], base["output_tokens_per_s"]),
            }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def markdown_table(result: dict[str, Any]) -> str:
    """The README's table: client (SSE) / engine (stored events) for every chat ITL figure."""
    head = (
        "| window | chat ITL p50 | p99 | p99.9 | max | chat TPOT p50 / p99 | RAG TTFT p50 / p99 "
        "| chat TTFT p50 / p99 | output tok/s |\n| --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |"
    )
    lines = [head]
    for c, e in zip(result["client"], result["engine"], strict=True):
        name = f"budget {c['window']}" if c["window"] != "unchunked" else "`unchunked`"
        cells = [name]
        for key in ("chat_itl_p50_ms", "chat_itl_p99_ms", "chat_itl_p999_ms", "chat_itl_max_ms"):
            cells.append(f"{_ms(c[key])} / {_ms(e[key])}")
        cells.append(f"{_ms(c['chat_tpot_p50_ms'])} / {_ms(c['chat_tpot_p99_ms'])}")
        cells.append(f"{_ms(c['rag_ttft_p50_ms'])} / {_ms(c['rag_ttft_p99_ms'])}")
        cells.append(f"{_ms(c['chat_ttft_p50_ms'])} / {_ms(c['chat_ttft_p99_ms'])}")
        cells.append(f"{c['output_tokens_per_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_table(result: dict[str, Any]) -> None:
    from benchmarks._common import table

    for side in ("client", "engine"):
        rows = [
            [
                r["window"],
                r["chat_itl_p50_ms"],
                r["chat_itl_p99_ms"],
                r["chat_itl_p999_ms"],
                r["chat_itl_max_ms"],
                r["chat_tpot_p50_ms"],
                r["chat_tpot_p99_ms"],
                r["rag_ttft_p50_ms"],
                r["rag_ttft_p99_ms"],
                r["output_tokens_per_s"],
            ]
            for r in result[side]
        ]
        print(f"\n{side}:")
        print(
            table(
                rows,
                [
                    "window",
                    "itl p50",
                    "p99",
                    "p99.9",
                    "max",
                    "tpot p50",
                    "p99",
                    "rag ttft p50",
                    "p99",
                    "tok/s",
                ],
            )
        )
    for key in ("cost_model", "cost_model_minus_cpu_wait"):
        cm = result.get(key)
        if cm:
            print(
                f"\n{key}: served/predicted step time: p50 {cm['served_ratio_p50']:.2f} "
                f"p95 {cm['served_ratio_p95']:.2f} (in-process vs its own fit: p50 "
                f"{cm['inproc_ratio_p50']:.2f} p95 {cm['inproc_ratio_p95']:.2f}); between "
                f"steps p50/p95 served {cm['between_steps_ms']['served_p50']:.2f}/"
                f"{cm['between_steps_ms']['served_p95']:.2f} ms, in-process "
                f"{cm['between_steps_ms']['inproc_p50']:.2f}/"
                f"{cm['between_steps_ms']['inproc_p95']:.2f} ms"
            )
    for row in result["process_cpu"]:
        print(row)
    print("\n" + markdown_table(result))
    print(json.dumps(result["targets"], indent=1))
    print(json.dumps(result.get("served_trace"), indent=1))
    print(json.dumps(result.get("inproc_trace"), indent=1))


if __name__ == "__main__":
    sys.exit(main())
