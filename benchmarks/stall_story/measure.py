"""The stall story's measurement: the same traffic in process on ``LLMEngine`` (the reference
the cost model is fitted on) and on the served path (``python -m engine`` with its telemetry in a
collector's store), each returned raw."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import (
    start_engine_server,
    stop_engine_server,
)
from benchmarks.stall_story.workload import ClientRequest, Traffic, Window

logger = logging.getLogger("stall")


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


async def stream_completion(
    session: Any, url: str, model: str, prompt: list[int], max_tokens: int, cls: str
) -> ClientRequest:
    """One streamed completion, timed as the client sees it: every SSE chunk with choices is a
    token (empty text included); errors are recorded, never raised."""
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
                if obj.get("usage"):
                    rec.completion_tokens = obj["usage"].get("completion_tokens")
                if "chunkscope" in obj:  # our engine's extension rides on the usage chunk
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
                rec = await stream_completion(
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
                        stream_completion(
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
        stop_engine_server(proc)
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
