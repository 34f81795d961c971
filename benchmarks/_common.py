"""Shared helpers for the benchmarks: machine info, stats, engine construction, JSON output."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO_ROOT = Path(__file__).resolve().parent.parent


def machine_info() -> dict[str, Any]:
    import transformers

    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cuda_available": torch.cuda.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:  # read-only
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001
        info["git_commit"] = None
    return info


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


def random_prompt(rng: random.Random, n: int) -> list[int]:
    """BOS then random bytes (ids 0..255: no EOS / image placeholder / pad)."""
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


def make_engine(
    preset: str,
    *,
    token_budget: int,
    max_model_len: int,
    max_token_budget: int = 8192,
    prefix_caching: bool = False,
    seed: int = 0,
):  # type: ignore[no-untyped-def]
    from engine.config import EngineConfig
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


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")


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
