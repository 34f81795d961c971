"""The blame ledger checked against the counterfactual, on the served engine.

One engine (``python -m engine``, the CPU ``demo`` preset) reports to a collector on a
temporary SQLite store. For each traffic mix the same seeded, open-loop traffic is sent twice:
once with its long RAG prompts (the culprits), once without them, the order alternating from
pair to pair. Chat requests are sent at the same offsets, with the same prompt and output
lengths (``ignore_eos``), in both runs; every run draws fresh prompt content, so no run finds
another's prompts in the prefix cache. The victims are these chat requests, paired by their
place in the schedule.

- **measured**: the chats' time from arrival to last token summed, with the culprits minus
  without (from the store's token times);
- **blamed**: what the ledger (``chunkscope blame``'s, fitted on the run with the culprits)
  attributes to the culprits in those chats' gaps.

The target: blamed within 20% of measured on each mix. Besides, the ledger's speed: a
one-minute window of a simulated busy engine (64 chat streams and long prompts, written into a
store as telemetry) read and blamed, timed.

Run from the repo root:  .venv/bin/python -m benchmarks.blame [--quick]
Writes benchmarks/results/blame.json (--quick: short runs, results to a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import (
    add_common_args,
    config_of,
    setup,
    start_engine_server,
    stop_engine_server,
    write_json,
)

logger = logging.getLogger("blame")
SCRIPT = "blame.py"
ENGINE_ID = "blame-bench"
_SALT = itertools.count(1)  # each run's prompt content


@dataclass(frozen=True)
class Mix:
    name: str
    token_budget: int
    rag_min: int
    rag_max: int


MIXES = {
    # a long prompt prefilled in one step: every chat waits for all of it at once
    "one-step": Mix("one-step", 4096, 1000, 1600),
    # the same prompts in 512-token chunks: many short stalls, and new chats queue behind them
    "chunked": Mix("chunked", 512, 1000, 1600),
}


@dataclass(frozen=True)
class Planned:
    index: int
    offset_s: float
    traffic_class: str
    length: int  # prompt tokens (their content is drawn afresh for every run)
    max_tokens: int


@dataclass
class Sent:
    index: int
    traffic_class: str
    request_id: str | None = None
    error: str | None = None


def plan(mix: Mix, args: argparse.Namespace, seed: int) -> list[Planned]:
    """Chats on a fixed period with seeded prompt lengths, long prompts on their own period."""
    rng = random.Random(seed)
    out: list[Planned] = []
    t, i = 0.0, 0
    while t < args.duration_s:
        out.append(Planned(i, t, "chat", rng.randint(40, 160), args.chat_output))
        i += 1
        t += args.chat_every_s
    t = args.rag_first_s
    while t < args.duration_s:
        n = rng.randint(mix.rag_min, mix.rag_max)
        out.append(Planned(i, t, "rag", n, args.rag_output))
        i += 1
        t += args.rag_every_s
    return sorted(out, key=lambda p: p.offset_s)


def prompt_ids(p: Planned, salt: int) -> list[int]:
    """BOS and ``p.length - 1`` seeded random bytes, new for each ``salt`` (run)."""
    rng = random.Random(salt * 1_000_003 + p.index)
    return [256] + [rng.randrange(256) for _ in range(p.length - 1)]


async def _send(session: Any, url: str, model: str, p: Planned, rec: Sent, salt: int) -> None:
    body = {
        "model": model,
        "prompt": prompt_ids(p, salt),
        "max_tokens": p.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers={"x-traffic-class": p.traffic_class}
        ) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                rec.request_id = rec.request_id or obj.get("id")  # the id the client sees
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"


async def _drive(
    url: str, model: str, planned: list[Planned], with_culprits: bool, salt: int
) -> tuple[list[Sent], float, float]:
    import aiohttp

    sent: list[Sent] = []
    tasks = []
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        start = time.time()
        for p in planned:
            if p.traffic_class == "rag" and not with_culprits:
                continue
            await asyncio.sleep(max(0.0, t0 + p.offset_s - time.monotonic()))
            rec = Sent(p.index, p.traffic_class)
            sent.append(rec)
            tasks.append(asyncio.ensure_future(_send(session, url, model, p, rec, salt)))
        await asyncio.gather(*tasks)
    return sent, start, time.time()


def _victim_times(db: Any, sent: list[Sent]) -> dict[int, float]:
    """Per chat (by its place in the schedule): ms from arrival to last token, from the store."""
    from storage import queries

    out: dict[int, float] = {}
    for rec in sent:
        if rec.traffic_class != "chat" or rec.request_id is None:
            continue
        times = queries.token_times(db, engine_id=ENGINE_ID, request_id=rec.request_id)
        if times.empty:
            continue
        lo, hi = float(times["time"].min()), float(times["time"].max())
        reqs = queries.requests(db, engine_id=ENGINE_ID, since=lo, until=hi)
        row = reqs[reqs["request_id"] == rec.request_id]
        if row.empty or row["arrival"].isna().all():
            continue
        out[rec.index] = (hi - float(row["arrival"].iloc[-1])) * 1e3
    return out


def _wait_stored(db: Any, sent: list[Sent], timeout: float = 30.0) -> None:
    """Until the store has every chat's last token (the publisher lags about 0.1 s)."""
    from storage import queries

    ids = {r.request_id for r in sent if r.request_id}
    deadline = time.time() + timeout
    while time.time() < deadline:
        reqs = queries.requests(db, engine_id=ENGINE_ID)
        done = set(reqs.loc[reqs["finished"].notna(), "request_id"])
        if ids <= done:
            return
        time.sleep(0.5)
    logger.warning("%d requests never reached the store", len(ids - done))


def _one_pair(
    url: str, db: Any, planned: list[Planned], args: argparse.Namespace, k: int
) -> dict[str, Any]:
    """The traffic with its culprits and without (pair ``k``: with first when even): the
    victims' times in each, and the ledger's blame (of the run with them) per victim, by place
    in the schedule."""
    from advisor.blame_store import blame_window

    runs: dict[str, Any] = {}
    order = (("with", True), ("without", False))
    for label, with_culprits in order if k % 2 == 0 else order[::-1]:
        time.sleep(args.settle_s)
        salt = next(_SALT)
        sent, start, end = asyncio.run(_drive(url, args.preset, planned, with_culprits, salt))
        _wait_stored(db, sent)
        runs[label] = {"sent": sent, "start": start, "end": end + 1.0}
        errors = [r.error for r in sent if r.error]
        if errors:
            logger.warning("%s: %d errors, e.g. %s", label, len(errors), errors[0])
    t = time.perf_counter()
    blamed = blame_window(
        db, engine_id=ENGINE_ID, since=runs["with"]["start"] - 1.0, until=runs["with"]["end"]
    )
    ledger_s = time.perf_counter() - t
    sent = runs["with"]["sent"]
    culprits = {r.request_id for r in sent if r.traffic_class == "rag"}
    by_index = {r.index: r.request_id for r in sent}
    with_t = _victim_times(db, sent)
    without_t = _victim_times(db, runs["without"]["sent"])
    blame: dict[int, float] = {}
    excess: dict[int, float] = {}
    for i in set(with_t) & set(without_t):
        out = blamed.ledger.request(str(by_index[i]))
        blame[i] = sum(c["ms"] for c in out["culprits"] if c["request_id"] in culprits)
        excess[i] = out["excess_ms"]
    offenders = blamed.ledger.offenders(len(culprits))
    m = blamed.fit.model
    return {
        "with": with_t,
        "without": without_t,
        "blame": blame,
        "excess": excess,
        "num_culprits": len(culprits),
        "offenders_that_are_culprits": sum(1 for o in offenders if o["request_id"] in culprits),
        "ledger_s": ledger_s,
        "loadavg_1m": os.getloadavg()[0],
        "fit": {
            "rel_err_p50": m.rel_err_p50,
            "poor": blamed.fit.poor,
            "reasons": blamed.fit.quality.get("reasons"),
            "model": m.to_dict(),
        },  # fmt: skip
    }


def run_mix(url: str, db: Any, mix: Mix, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """``args.pairs`` pairs of runs (with, without) of the same traffic at the mix's budget;
    per victim, its times and its blame averaged over the pairs."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/v1/scheduler",
        data=json.dumps({"token_budget": mix.token_budget}).encode(),
        method="PUT",
        headers={"content-type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=30).read()
    planned = plan(mix, args, seed)
    pairs = [_one_pair(url, db, planned, args, k) for k in range(args.pairs)]
    victims = sorted(set.intersection(*(set(p["blame"]) for p in pairs)))

    def mean(key: str, i: int) -> float:
        return statistics.fmean(p[key][i] for p in pairs)

    measured = sum(mean("with", i) - mean("without", i) for i in victims)
    blamed = sum(mean("blame", i) for i in victims)
    per_pair = [
        {
            "measured_ms": sum(p["with"][i] - p["without"][i] for i in victims),
            "blamed_ms": sum(p["blame"][i] for i in victims),
            "victims_ms_with": sum(p["with"][i] for i in victims),
            "victims_ms_without": sum(p["without"][i] for i in victims),
            "victims_excess_ms": sum(p["excess"][i] for i in victims),
            **{
                k: p[k]
                for k in (
                    "num_culprits",
                    "offenders_that_are_culprits",
                    "ledger_s",
                    "loadavg_1m",
                    "fit",
                )
            },  # fmt: skip
        }
        for p in pairs
    ]
    return {
        "mix": mix.__dict__,
        "seed": seed,
        "pairs": args.pairs,
        "num_victims": len(victims),
        "measured_ms": measured,
        "blamed_ms": blamed,
        "blamed_over_measured": blamed / measured if measured > 0 else None,
        "within_20pct": measured > 0 and abs(blamed / measured - 1) <= 0.2,
        "per_pair": per_pair,
        "per_victim_ms": {
            str(i): {
                "with": mean("with", i),
                "without": mean("without", i),
                "blamed": mean("blame", i),
            }  # fmt: skip
            for i in victims
        },
    }


# ---- speed ------------------------------------------------------------------------------------


def busy_minute_store(path: Path, streams: int, seconds: float) -> tuple[str, int]:
    """A store holding ``seconds`` of a simulated busy engine: ``streams`` chat streams
    (replaced as they finish) and a 3,000-token prompt every 2 s, at budget 2048, step times
    from a fixed cost model. Returns (URL, steps)."""
    from advisor.simulate import EngineShape, SimRequest, cost_model_step_ns, simulate
    from engine.core.cost_model import CostModel
    from storage import db as dbm
    from storage.store import Events, Hello, Store
    from wire.events import ChunkRecord, RequestEvent, StepEvent

    model = CostModel(const=3e-3, prefill=60e-6, decode=150e-6, attn=2e-9)
    shape = EngineShape(num_kv_blocks=200_000, max_num_seqs=512, max_token_budget=8192)
    rng = random.Random(0)
    reqs = []
    for i in range(int(seconds * streams / 2.5)):
        t = int(i * 2.5e9 / streams)
        ids = tuple(i * 10_000 + k for k in range(rng.randint(50, 200)))
        reqs.append(SimRequest(f"cmpl-chat{i}", t, ids, 120, "chat"))
    for j in range(int(seconds / 2)):
        ids = tuple(10**9 + j * 10_000 + k for k in range(3000))
        reqs.append(SimRequest(f"cmpl-rag{j}", int(j * 2e9), ids, 4, "rag"))
    res = simulate(reqs, shape, token_budget=2048, step_ns=cost_model_step_ns(model.predict),
                   gap_ns=300_000, record_steps=True)  # fmt: skip
    mono0 = 10**12
    events: list[dict[str, Any]] = []
    by_id = {r.request_id: r for r in reqs}
    produced = {r.request_id: 0 for r in reqs}
    pending = sorted(reqs, key=lambda r: r.arrival_ns)
    k = 0
    for s in res.steps:
        while k < len(pending) and pending[k].arrival_ns <= s.start_ns:
            r = pending[k]
            events.append(RequestEvent(kind="arrived", request_id=r.request_id,
                          time_ns=mono0 + r.arrival_ns, traffic_class=r.traffic_class,
                          num_prompt_tokens=len(r.prompt_token_ids)).to_dict())  # fmt: skip
            k += 1
        after = []
        for c in s.chunks:
            if c.produced_token:
                produced[c.request_id] += 1
                if produced[c.request_id] == by_id[c.request_id].num_output_tokens:
                    after.append(RequestEvent(kind="finished", request_id=c.request_id,
                                 time_ns=mono0 + s.end_ns, finish_reason="length",
                                 num_output_tokens=produced[c.request_id]).to_dict())  # fmt: skip
        events.append(StepEvent(
            step=s.step, start_ns=mono0 + s.start_ns, end_ns=mono0 + s.end_ns,
            token_budget=s.token_budget, policy="chunked",
            num_decode_tokens=sum(c.num_tokens for c in s.chunks if c.kind == "decode"),
            num_prefill_tokens=sum(c.num_tokens for c in s.chunks if c.kind == "prefill"),
            num_scheduled_tokens=sum(c.num_tokens for c in s.chunks), num_running=len(s.chunks),
            num_waiting=0, kv_blocks_used=0, kv_blocks_total=shape.num_kv_blocks,
            num_preemptions=0, forward_ns=s.end_ns - s.start_ns,
            chunks=[ChunkRecord(c.request_id, c.kind, c.start, c.num_tokens, c.produced_token)
                    for c in s.chunks],
        ).to_dict())  # fmt: skip
        events.extend(after)
    for seq, e in enumerate(events, start=1):
        e["seq"] = seq
    url = f"sqlite:///{path}"
    db = dbm.connect(url)
    dbm.migrate(db)
    store = Store(db)
    try:
        hello = {"schema": 1, "type": "hello", "engine_id": "busy", "run_id": "run-1",
                 "model": "simulated", "host": "localhost", "pid": 1, "policy": "chunked",
                 "token_budget": 2048, "max_token_budget": 8192,
                 "kv_blocks_total": shape.num_kv_blocks, "block_size": 16,
                 "config": {"model": "simulated"},
                 "clock": {"wall_ns": 1_700_000_000 * 10**9, "mono_ns": mono0}}  # fmt: skip
        (info,) = store.apply([Hello(hello)])
        for i in range(0, len(events), 2000):
            store.apply([Events(info.run_key, events[i : i + 2000])])
    finally:
        store.close()
        db.dispose()
    return url, len(res.steps)


def speed(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from advisor.blame_store import blame_window
    from storage import db as dbm
    from storage import queries

    url, steps = busy_minute_store(workdir / "busy.db", args.busy_streams, args.busy_s)
    db = dbm.connect(url, readonly=True)
    try:
        all_steps = queries.steps(db)
        lo, hi = float(all_steps["start"].min()), float(all_steps["end"].max())
        chunks = int(all_steps["num_chunks"].sum())
        timings: dict[str, list[float]] = {"window_s": [], "top10_s": [], "request_s": []}
        for _ in range(args.repeats):
            t = time.perf_counter()
            blamed = blame_window(db, engine_id="busy", since=lo, until=hi)
            timings["window_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            top = blamed.ledger.offenders(10)
            timings["top10_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            blamed.ledger.request("cmpl-chat100")
            timings["request_s"].append(time.perf_counter() - t)
    finally:
        db.dispose()
    return {
        "steps": steps,
        "chunks": chunks,
        "window_s_of_traffic": hi - lo,
        "streams": args.busy_streams,
        **{k: statistics.median(v) for k, v in timings.items()},
        "all": timings,
        "top_offender_class": top[0]["traffic_class"] if top else None,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", default="one-step,chunked", help=f"among {', '.join(MIXES)}")
    ap.add_argument("--duration-s", type=float, default=40.0, help="traffic per run")
    ap.add_argument("--pairs", type=int, default=2, help="runs with and without, per mix")
    ap.add_argument("--chat-every-s", type=float, default=1.5)
    ap.add_argument("--chat-output", type=int, default=40)
    ap.add_argument("--rag-first-s", type=float, default=3.0)
    ap.add_argument("--rag-every-s", type=float, default=8.0)
    ap.add_argument("--rag-output", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=3.0, help="idle before each run")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--core-threads", type=int, default=None, help="the engine's --cpu-threads")
    ap.add_argument("--busy-streams", type=int, default=64)
    ap.add_argument("--busy-s", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-served", action="store_true", help="only the speed measurement")
    add_common_args(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration_s, args.busy_s, args.repeats, args.pairs = 10.0, 10.0, 2, 1
        args.chat_output, args.rag_every_s, args.rag_first_s = 20, 4.0, 1.0
    args.preset = "tiny" if args.quick else "demo"
    out_dir = setup(args)
    mixes = [MIXES[m.strip()] for m in args.mixes.split(",") if m.strip()]
    from storage.db import connect
    from testkit.collector import start_collector

    results: dict[str, Any] = {"mixes": []}
    with tempfile.TemporaryDirectory(prefix="blame-bench-") as tmp:
        work = Path(tmp)
        results["speed"] = speed(args, work)
        print(json.dumps({"speed": {k: v for k, v in results["speed"].items() if k != "all"}}),
              flush=True)  # fmt: skip
        if not args.skip_served:
            db_url = f"sqlite:///{work / 'served.db'}"
            collector = start_collector(db_url, args=["--log-level", "WARNING"])
            cmd = [sys.executable, "-m", "engine", "--model", args.preset,
                   "--port", "0", "--device", "cpu", "--dtype", "float32",
                   "--token-budget", "4096", "--max-token-budget", "8192",
                   "--max-model-len", "4096", "--engine-id", ENGINE_ID,
                   "--collector-url", collector.url, "--log-level", "warning"]  # fmt: skip
            if args.core_threads is not None:
                cmd += ["--cpu-threads", str(args.core_threads)]
            proc, url = start_engine_server(cmd, timeout=300, stdout=subprocess.DEVNULL)
            db = connect(db_url, readonly=True)
            try:
                for k, mix in enumerate(mixes):
                    res = run_mix(url, db, mix, args, args.seed + k)
                    results["mixes"].append(res)
                    keys = (
                        "mix",
                        "num_victims",
                        "measured_ms",
                        "blamed_ms",
                        "blamed_over_measured",
                    )
                    print(json.dumps({x: res[x] for x in keys}), flush=True)
            finally:
                stop_engine_server(proc)
                db.dispose()
                collector.stop()
    results["target_met"] = bool(results["mixes"]) and all(
        m["within_20pct"] for m in results["mixes"]
    )
    write_json(out_dir / "blame.json", results, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
