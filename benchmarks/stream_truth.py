"""Does the client see each token when the engine makes it? Client gaps against the store's.

For every streamed token k >= 2 the client's gap before it (SSE chunk to SSE chunk, one chunk
with choices = one token, empty text included) is set against the gap the store recorded for
the same token (``storage.queries.token_itl``: end of the step that made token k minus the end
of the step that made token k-1). When the two agree the dashboard's inter-token latency is
what clients lived through; when tokens wait somewhere between the step and the socket, the
client's gaps come in bunches (a long one, then several near zero) while the store's are even.

Per arm: the engine (``python -m engine`` on a local random-weight Llama folder, or
``--model demo``) streams to a collector (SQLite in a temporary folder) and serves
``--streams`` closed-loop completions of ``--tokens`` tokens; optionally a ``--long-prompt``
every ``--long-every-s``. Reported: steps/s (from the store's gaps), |client gap - store gap|
p50/p99/max, the share of bunched tokens (client gap < 0.5 ms where the store's gap is >= 1 ms),
client and store ITL p50/p99/max.

Two speeds by default: ``fast`` (hidden 128, 2 layers: hundreds of steps a second) and
``demo`` (the dashboard's demo engine). ``--compare-ref REF`` alternates every arm with the same
arm on a worktree of git REF (the comparison the JSON's ``ratios`` report), so a change to the
path between step and socket is measured side by side in one run.

Run from the repo root:  .venv/bin/python -m benchmarks.stream_truth [--quick] [--compare-ref REF]
Writes benchmarks/results/stream_truth.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    REPO_ROOT,
    add_common_args,
    config_of,
    setup,
    start_engine_server,
    stop_engine_server,
    write_json,
)

SCRIPT = "stream_truth.py"
BUNCH_CLIENT_MS = 0.5  # a client gap under this ...
BUNCH_ENGINE_MS = 1.0  # ... where the engine's gap was at least this: a token held back
logger = logging.getLogger("stream_truth")


# --- one arm ------------------------------------------------------------------------------------
async def _stream(session: Any, url: str, model: str, prompt: list[int], n: int) -> dict[str, Any]:
    """One streamed completion as the client sees it: the arrival time of every chunk with
    choices, and the engine's request id (the ``chunkscope`` block of the usage chunk)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    rec: dict[str, Any] = {"times": [], "request_id": None, "error": None}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}"
                return rec
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("choices"):
                    rec["times"].append(now)
                if "chunkscope" in obj:
                    rec["request_id"] = obj["chunkscope"].get("request_id")
    except Exception as exc:  # noqa: BLE001 - recorded; the arm goes on
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


async def _drive(args: argparse.Namespace, url: str, vocab: int) -> list[dict[str, Any]]:
    import aiohttp
    import httpx

    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]

    done: list[dict[str, Any]] = []
    end = time.monotonic() + args.warmup_s + args.window_s
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def chat() -> None:
            while time.monotonic() < end:
                done.append(
                    await _stream(session, url, model, prompt(args.chat_prompt), args.tokens)
                )

        async def longs() -> None:
            while args.long_prompt and time.monotonic() < end - args.long_every_s:
                await asyncio.sleep(args.long_every_s)
                await _stream(session, url, model, prompt(args.long_prompt), 1)

        await asyncio.gather(*(chat() for _ in range(args.streams)), longs())
    return done


def _store_gaps(db_url: str, timeout: float = 30.0) -> dict[str, dict[int, float]]:
    """request id -> {k: the store's gap before token k in ms}, once the store holds them."""
    from storage.db import connect
    from storage.queries import token_itl

    db = connect(db_url, readonly=True)
    try:
        deadline = time.monotonic() + timeout
        last = -1
        while True:  # the publisher's last frames land shortly after the traffic stops
            itl = token_itl(db)
            if len(itl) == last or time.monotonic() > deadline:
                break
            last = len(itl)
            time.sleep(2.0)
    finally:
        db.dispose()
    out: dict[str, dict[int, float]] = {}
    for rid, k, ms in zip(itl["request_id"], itl["k"], itl["itl_ms"], strict=True):
        out.setdefault(str(rid), {})[int(k)] = float(ms)
    return out


def run_arm(
    args: argparse.Namespace, speed: str, dtype: str, tree: Path, folder: Path | None
) -> dict[str, Any]:
    """One engine on ``tree`` (a checkout), its collector, the traffic; the figures."""
    from testkit.collector import start_collector

    with tempfile.TemporaryDirectory(prefix="stream-truth-") as tmp:
        db_url = f"sqlite:///{tmp}/store.db"
        collector = start_collector(db_url, args=["--allow-unauthenticated"], tree=tree)
        model = ["--model", "demo" if folder is None else str(folder)]
        cmd = [
            sys.executable, "-m", "engine", *model, "--port", "0", "--device", "cpu",
            "--dtype", dtype, "--token-budget", str(args.budget), "--log-level", "warning",
            "--collector-url", collector.url, "--allow-unauthenticated",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
        try:
            proc, url = start_engine_server(
                cmd, env=env, timeout=300, stdout=subprocess.DEVNULL, cwd=tree
            )
            try:
                requests = asyncio.run(_drive(args, url, vocab=256))
            finally:
                stop_engine_server(proc)
            store = _store_gaps(db_url)
        finally:
            collector.stop()
    return figures(requests, store, args.warmup_s)


def figures(
    requests: list[dict[str, Any]], store: dict[str, dict[int, float]], warmup_s: float
) -> dict[str, Any]:
    """Client gap against store gap for every token k >= 2 of every complete request that began
    after the warm-up (a token's client gap = its chunk's arrival - the previous chunk's)."""
    t0 = min((r["times"][0] for r in requests if r["times"]), default=0.0) + warmup_s
    client, engine = [], []
    unmatched = errors = 0
    for r in requests:
        if r["error"]:
            errors += 1
            continue
        gaps = store.get(str(r["request_id"]))
        times = r["times"]
        if not times or times[0] < t0:
            continue
        if gaps is None or len(gaps) != len(times) - 1:
            unmatched += 1
            continue
        for k in range(2, len(times) + 1):
            client.append((times[k - 1] - times[k - 2]) * 1e3)
            engine.append(gaps[k])
    c, e = np.asarray(client), np.asarray(engine)
    if c.size == 0:
        return {"tokens": 0, "requests_unmatched": unmatched, "errors": errors}
    diff = np.abs(c - e)
    bunched = (c < BUNCH_CLIENT_MS) & (e >= BUNCH_ENGINE_MS)

    def pct(x: np.ndarray, q: float) -> float:
        return round(float(np.percentile(x, q)), 3)

    return {
        "tokens": int(c.size),
        "requests_unmatched": unmatched,
        "errors": errors,
        "steps_per_s": round(1e3 / float(np.median(e)), 1),
        "diff_ms": {"p50": pct(diff, 50), "p99": pct(diff, 99), "max": round(float(diff.max()), 3)},
        "bunched_share": round(float(bunched.mean()), 4),
        "client_itl_ms": {"p50": pct(c, 50), "p99": pct(c, 99), "max": round(float(c.max()), 3)},
        "store_itl_ms": {"p50": pct(e, 50), "p99": pct(e, 99), "max": round(float(e.max()), 3)},
    }


# --- the run ------------------------------------------------------------------------------------
def worktree(ref: str, where: Path) -> Path:
    """A detached worktree of ``ref`` (removed by the caller)."""
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(where), ref],
        cwd=REPO_ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return where


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--speeds", default="fast,demo", help="fast (tiny folder) and/or demo")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--streams", type=int, default=6, help="closed-loop streams")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per streamed completion")
    ap.add_argument("--chat-prompt", type=int, default=200)
    ap.add_argument(
        "--long-prompt", type=int, default=0, help="a long prompt now and then (0: none)"
    )
    ap.add_argument("--long-every-s", type=float, default=4.0)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128, help="the fast speed's folder")
    ap.add_argument("--layers", type=int, default=2, help="the fast speed's folder")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--pairs", type=int, default=1, help="rounds (with --compare-ref: ref, head)")
    ap.add_argument("--compare-ref", default=None, help="alternate each arm with this git ref")
    ap.add_argument(
        "--head-ref",
        default=None,
        help="run the head arm on a worktree of this ref (default: the checkout)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if args.quick:
        args.window_s, args.warmup_s, args.speeds, args.dtypes = 4.0, 1.0, "fast", "float32"
    from tests.chunkscope.integrations.vllm_helpers import build_llama_folder

    results: dict[str, Any] = {"arms": []}
    with tempfile.TemporaryDirectory(prefix="stream-truth-trees-") as tmp:
        head = worktree(args.head_ref, Path(tmp) / "head") if args.head_ref else REPO_ROOT
        trees = {"head": head}
        if args.compare_ref:
            trees = {"ref": worktree(args.compare_ref, Path(tmp) / "ref"), "head": head}
        try:
            folder = build_llama_folder(
                Path(tmp) / "llama", hidden_size=args.hidden, num_layers=args.layers,
                max_positions=8192,
            )  # fmt: skip
            for speed in args.speeds.split(","):
                for dtype in args.dtypes.split(","):
                    for k in range(args.pairs):
                        for name, tree in trees.items():
                            logger.warning("%s %s round %d: %s", speed, dtype, k, name)
                            fig = run_arm(
                                args, speed, dtype, tree, folder if speed == "fast" else None
                            )
                            arm = {"speed": speed, "dtype": dtype, "round": k, "tree": name, **fig}
                            print(json.dumps(arm), flush=True)
                            results["arms"].append(arm)
        finally:
            for tree in trees.values():
                if tree != REPO_ROOT:
                    subprocess.run(
                        ["git", "worktree", "remove", "--force", str(tree)],
                        cwd=REPO_ROOT, capture_output=True,
                    )  # fmt: skip
    results["compare_ref"], results["head_ref"] = args.compare_ref, args.head_ref
    write_json(out_dir / "stream_truth.json", results, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
