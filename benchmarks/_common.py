"""Shared helpers for the benchmarks: provenance, command-line conventions, stats, engine
construction, JSON output.

Every results file is written by :func:`write_json`, which puts the same ``provenance`` block at
its top (git commit and whether the tree was dirty, torch version and threads, the machine) next
to the benchmark's full ``config`` (every command-line argument, defaults included), so a number
can be traced to the code and settings that produced it.

``--quick`` runs a script end to end with fewer sizes and repetitions (a smoke test of the
script, not a measurement); its results go to a temporary folder unless ``--out-dir`` says
otherwise, so quick numbers never land in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wire.ready import ENGINE_READY, ReadyWatch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICK_DIR = Path(tempfile.gettempdir()) / "chunkscope-bench-quick"
REPO_ROOT = Path(__file__).resolve().parent.parent

logger = logging.getLogger(__name__)

# Environment variables that change how many threads the numeric libraries use.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


# --- provenance ---------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """The commit the tree is at and whether it differs from it (tracked or untracked files,
    ignored ones excluded). A dirty tree means the numbers may not come from that commit.

    Files under ``benchmarks/results/`` do not make a tree dirty (they are outputs, not code:
    a chain of benchmark runs writes them one after another); they are listed apart in
    ``git_changed_results``."""
    commit = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--untracked-files=all")
    paths = [line[3:] for line in (status or "").splitlines() if line.strip()]
    results = [p for p in paths if p.startswith("benchmarks/results/")]
    changed = [p for p in paths if not p.startswith("benchmarks/results/")]
    return {
        "git_commit": commit,
        "git_dirty": None if status is None else bool(changed),
        "git_changed_paths": changed[:50],
        "git_num_changed_paths": len(changed),
        "git_changed_results": results[:50],
    }


def machine_info() -> dict[str, Any]:
    """The machine and the numeric stack: CPU count, platform, torch and its threads."""
    import torch

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import transformers

        info["transformers_version"] = transformers.__version__
    except ImportError:
        info["transformers_version"] = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    # the vector and matrix units that decide CPU kernel speed (one machine
                    # kind of this project has AMX, another only AVX-512)
                    flags = set(line.split(":", 1)[1].split())
                    info["cpu_matrix_flags"] = sorted(flags & MATRIX_FLAGS)
                if "cpu_model" in info and "cpu_matrix_flags" in info:
                    break
    except OSError:
        pass
    return info


MATRIX_FLAGS = frozenset(
    {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_int8",
     "amx_tile"}
)  # fmt: skip


_AT_START: dict[str, Any] = {}


def provenance(script: str) -> dict[str, Any]:
    """Where the numbers come from: the tree as it was when the run started (``setup``), and,
    when it moved during the run (a commit or an edit), the tree at the end as well."""
    now = git_state()
    started = _AT_START.get("git") or now
    doc = {"script": script, "command": [Path(sys.argv[0]).name, *sys.argv[1:]], **started}
    if now != started:
        doc["git_at_end"] = now
    doc["machine"] = machine_info()
    return doc


# --- command line -------------------------------------------------------------------------------
def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--quick",
        action="store_true",
        help="run end to end with fewer sizes and repetitions (a smoke test, not a measurement; "
        f"results go to {QUICK_DIR} unless --out-dir is given)",
    )
    ap.add_argument("--out-dir", type=Path, default=None, help=f"default {RESULTS_DIR}")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: torch's own choice; recorded either way)",
    )


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind the script as Ctrl-C does: SystemExit(143)
    from wherever the main thread is, so every ``finally`` stops the engines, collectors and
    load generators the script started. Left at the default, SIGTERM ends the script at once
    and its children run on, holding ports, CPU and stores. Only from the main thread (signal
    handlers can be installed nowhere else); a no-op elsewhere."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def setup(args: argparse.Namespace) -> Path:
    """Apply the common arguments (and note the tree's state: the run's provenance); return the
    folder results go to."""
    logging.basicConfig(level=logging.WARNING)
    exit_on_sigterm()
    _AT_START["git"] = git_state()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.out_dir is not None:
        return Path(args.out_dir)
    return QUICK_DIR if args.quick else RESULTS_DIR


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """Every argument, defaults included, as JSON-safe values."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, payload: dict[str, Any], *, script: str, config: dict[str, Any]) -> None:
    """Write a results file: provenance and the full configuration first, then the payload."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "provenance": provenance(script),
        "config": config,
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# --- measurement helpers ------------------------------------------------------------------------
def summarize(xs: list[float]) -> dict[str, float]:
    """Seconds in, milliseconds out."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    p90 = s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]
    return {
        "n": len(s),
        "median_ms": statistics.median(s) * 1e3,
        "mean_ms": statistics.fmean(s) * 1e3,
        "p90_ms": p90 * 1e3,
        "min_ms": s[0] * 1e3,
        "max_ms": s[-1] * 1e3,
    }


def contention_probe() -> dict[str, Any]:
    """Machine state at this moment: 1-minute load average and a fixed fp32 GEMM's speed
    (2048x512 @ 512x1536, best and median of 10). Other processes on a small machine make
    single timings noisy; these numbers let a reader judge a run."""
    import torch

    a, w = torch.randn(2048, 512), torch.randn(512, 1536)
    a @ w
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ w
        ts.append(time.perf_counter() - t0)
    flop = 2 * 2048 * 512 * 1536
    return {
        "loadavg_1m": os.getloadavg()[0],
        "gemm_gflops_best": flop / min(ts) / 1e9,
        "gemm_gflops_median": flop / statistics.median(ts) / 1e9,
    }


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """BOS then random bytes (ids 0..255: no EOS / image placeholder / pad)."""
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


# --- engine helpers -----------------------------------------------------------------------------
def make_engine(
    preset: str,
    *,
    token_budget: int,
    max_model_len: int,
    max_token_budget: int = 8192,
    prefix_caching: bool = False,
    seed: int = 0,
):  # type: ignore[no-untyped-def]
    from engine.core.config import EngineConfig
    from engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=preset,
        token_budget=token_budget,
        max_token_budget=max(max_token_budget, token_budget),
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        device="cpu",
        dtype="float32",
        attention_backend="sdpa",
        seed=seed,
    )
    return LLMEngine(cfg)


def engine_config_dict(engine) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    d = engine.config.to_dict()
    d["num_kv_blocks_effective"] = engine.block_manager.num_blocks
    d["attention_backend_effective"] = engine.runner.backend.name
    d["arch"] = engine.arch.to_dict()
    d["num_params"] = engine.arch.num_params
    return d


def drain(engine) -> None:  # type: ignore[no-untyped-def]
    """Abort everything still in the engine and step until it is empty."""
    for rid in list(engine._requests):  # noqa: SLF001 - benchmark bookkeeping only
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def prefill_step(engine, rng: random.Random, n: int) -> tuple[Any, float]:  # type: ignore[no-untyped-def]
    """One request of exactly n prompt tokens, budget n: a single prefill-only step.
    Returns the step's event and the wall seconds of the ``engine.step()`` call."""
    from engine.core.sampling_params import SamplingParams

    engine.set_token_budget(n)
    engine.add_request(
        random_prompt(rng, n), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    )
    t0 = time.perf_counter()
    res = engine.step()
    wall = time.perf_counter() - t0
    ev = res.event
    assert ev is not None and ev.num_prefill_tokens == n and ev.num_decode_tokens == 0, ev
    assert not engine.has_unfinished_requests(), "the 1-token request should have finished"
    return ev, wall


def decode_steps(  # type: ignore[no-untyped-def]
    engine, rng: random.Random, batch: int, prompt_len: int, warm: int, n: int, budget: int
) -> list[tuple[Any, float]]:
    """`batch` requests of prompt_len tokens; after their prefills, discard `warm` steady decode
    steps and return the next `n` (event, wall seconds of engine.step())."""
    from engine.core.sampling_params import SamplingParams

    engine.set_token_budget(budget)
    # the first requests start decoding while later ones still prefill: leave room for that
    prefill_steps = -(-batch * prompt_len // max(1, budget - batch)) + 1
    params = SamplingParams(
        max_tokens=warm + n + 4 + prefill_steps, temperature=0.0, ignore_eos=True
    )
    for _ in range(batch):
        engine.add_request(random_prompt(rng, prompt_len), params)
    out: list[tuple[Any, float]] = []
    seen = 0
    guard = 0
    while len(out) < n:
        guard += 1
        assert guard < 10_000
        t0 = time.perf_counter()
        res = engine.step()
        wall = time.perf_counter() - t0
        ev = res.event
        if ev is None:
            continue
        if ev.num_prefill_tokens == 0 and ev.num_decode_tokens == batch:
            seen += 1
            if seen > warm:
                out.append((ev, wall))
        elif seen:
            raise AssertionError(f"steady decode interrupted: {ev}")
    drain(engine)
    return out


def forward_s(ev: Any) -> float:
    """A StepEvent's model forward + logits time, seconds."""
    return ev.forward_ns / 1e9


# --- printing -----------------------------------------------------------------------------------
def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [[str(h) for h in header]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if isinstance(c, float):
        if c >= 100:
            return f"{c:.0f}"
        if c >= 10:
            return f"{c:.1f}"
        return f"{c:.2f}"
    return str(c)


# --- engine servers -----------------------------------------------------------------------------
def stop_engine_server(proc: subprocess.Popen[str]) -> None:
    """Stop a server :func:`start_engine_server` started: SIGINT (it drains and says goodbye),
    then a kill after 60 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def start_engine_server(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    stdout: int | None = None,
    cwd: Path | None = None,
) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m engine ... --port 0`` and return it with its URL, read from the line it
    prints when it listens. Its stderr is drained for as long as it runs (so it never blocks on
    a full pipe); when it does not start, the error carries its last 50 lines."""
    env = env if env is not None else {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        cmd, cwd=cwd or REPO_ROOT, env=env, stderr=subprocess.PIPE, stdout=stdout, text=True
    )
    assert proc.stderr is not None
    watch = ReadyWatch(proc.stderr, ENGINE_READY, keep=50)
    url = watch.wait(timeout)
    if url is None:
        proc.kill()
        raise RuntimeError(f"the engine server did not start: {cmd}\n" + watch.tail(50))
    return proc, url
