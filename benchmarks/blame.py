"""The blame ledger checked against the counterfactual, on the served engine.

One engine (``python -m engine``, the CPU ``demo`` preset) reports to a collector on a
temporary SQLite store. For each traffic mix one seeded, open-loop schedule is sent twice, as a
crossover: chat requests on a fixed period in both runs, and long RAG prompts (the culprits)
every few seconds, the even-numbered ones in one run and the odd-numbered ones in the other
(which run comes first alternates from pair to pair). Chats are sent at the same offsets, with
the same prompt and output lengths (``ignore_eos``), in both runs; every run draws fresh prompt
content, so no run finds another's prompts in the prefix cache.

The victims of a culprit are the chats the schedule sends from ``--victims-before-s`` before
it until that long before the next culprit (chosen from the schedule, not from any run's
outcome: every chat sent after the first culprit is the victim of exactly one):

- **measured**: each victim's time from arrival to last token (from the store's token times)
  in the run with its culprit minus in the run without it, summed;
- **blamed**: what the ledger (``chunkscope blame``'s, fitted on each run) attributes to the
  culprits in those victims' gaps in the run with their culprit, minus what it attributes to
  the culprits in the run without it (a neighbouring culprit, present there, whose cost
  reached them: the difference between the runs the ledger predicts), summed.

Each run holds half the culprits, so a machine slower during one run than the other adds to
both sides of the comparison alike (a plain "all culprits / none" pair puts all of that
difference into the measured figure). The chats before the first culprit are reported as
``controls``: their difference between the runs is the kind of noise the pairing removes.
``where_it_went`` splits the victims' measured difference by the ledger's parts of their time
in both runs (the culprits' blame, their own work, pauses, the other requests' shares), for the
victims their culprit reached and the others: what the ledger's first-order cost leaves out.

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
    # a culprit: its number among the culprits; a chat: the culprit whose victim it is (None:
    # a control, sent before the first culprit)
    episode: int | None = None


@dataclass
class Sent:
    index: int
    traffic_class: str
    request_id: str | None = None
    error: str | None = None


def plan(mix: Mix, args: argparse.Namespace, seed: int) -> list[Planned]:
    """Chats on a fixed period with seeded prompt lengths, long prompts on their own period;
    each chat from ``victims_before_s`` before a long prompt until that long before the next
    one is that prompt's victim."""
    rng = random.Random(seed)
    rags: list[Planned] = []
    t, i = args.rag_first_s, 10_000
    while t < args.duration_s:
        n = rng.randint(mix.rag_min, mix.rag_max)
        rags.append(Planned(i, t, "rag", n, args.rag_output, len(rags)))
        i += 1
        t += args.rag_every_s
    chats: list[Planned] = []
    t, i = 0.0, 0
    while t < args.duration_s:
        after = [r.episode for r in rags if r.offset_s - args.victims_before_s <= t]
        chats.append(Planned(i, t, "chat", rng.randint(40, 160), args.chat_output,
                             after[-1] if after else None))  # fmt: skip
        i += 1
        t += args.chat_every_s
    return sorted(chats + rags, key=lambda p: (p.offset_s, p.traffic_class))


def in_run(p: Planned, parity: int) -> bool:
    """Whether run ``parity`` (0 or 1) sends ``p``: every chat, the culprits of its parity."""
    return p.traffic_class != "rag" or (p.episode or 0) % 2 == parity


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
    url: str, model: str, planned: list[Planned], parity: int, salt: int
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
            if not in_run(p, parity):
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


def _blame_run(db: Any, run: dict[str, Any]) -> dict[str, Any]:
    """The ledger of one run: per chat, what it blames on the run's culprits and the parts of
    its time (``own``, ``pause``, ``excess``), and its fit."""
    from advisor.blame_store import blame_window

    t = time.perf_counter()
    blamed = blame_window(db, engine_id=ENGINE_ID, since=run["start"] - 1.0, until=run["end"])
    ledger_s = time.perf_counter() - t
    sent: list[Sent] = run["sent"]
    culprits = {r.request_id for r in sent if r.traffic_class == "rag"}
    blame: dict[int, float] = {}
    parts: dict[int, dict[str, float]] = {}
    for r in sent:
        if r.traffic_class != "chat" or r.request_id is None:
            continue
        try:
            out = blamed.ledger.request(str(r.request_id))
        except ValueError:  # no step in the window
            continue
        blame[r.index] = sum(c["ms"] for c in out["culprits"] if c["request_id"] in culprits)
        parts[r.index] = {k: out[f"{k}_ms"] for k in ("own", "pause", "excess")}
    offenders = blamed.ledger.offenders(len(culprits)) if culprits else []
    m = blamed.fit.model
    return {
        "blame": blame,
        "parts": parts,
        "num_culprits": len(culprits),
        "offenders_that_are_culprits": sum(1 for o in offenders if o["request_id"] in culprits),
        "ledger_s": ledger_s,
        "fit": {
            "rel_err_p50": m.rel_err_p50,
            "poor": blamed.fit.poor,
            "reasons": blamed.fit.quality.get("reasons"),
            "model": m.to_dict(),
        },  # fmt: skip
    }


def _one_pair(
    url: str, db: Any, planned: list[Planned], args: argparse.Namespace, k: int
) -> dict[str, Any]:
    """Both runs of the crossover (pair ``k``: the even culprits first when ``k`` is even):
    per chat, its time in each run and what each run's ledger blames on the culprits."""
    runs: dict[int, dict[str, Any]] = {}
    for parity in (0, 1) if k % 2 == 0 else (1, 0):
        time.sleep(args.settle_s)
        salt = next(_SALT)
        sent, start, end = asyncio.run(_drive(url, args.preset, planned, parity, salt))
        _wait_stored(db, sent)
        runs[parity] = {"sent": sent, "start": start, "end": end + 1.0,
                        "loadavg_1m": os.getloadavg()[0]}  # fmt: skip
        errors = [r.error for r in sent if r.error]
        if errors:
            logger.warning("run %d: %d errors, e.g. %s", parity, len(errors), errors[0])
    out: dict[str, Any] = {"first": 0 if k % 2 == 0 else 1}
    for parity, run in runs.items():
        out[f"run{parity}"] = {
            "times": _victim_times(db, run["sent"]),
            "loadavg_1m": run["loadavg_1m"],
            **_blame_run(db, run),
        }
    return out


def summarize_pairs(planned: list[Planned], pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per victim, its time in the run with its culprit minus in the run without it
    (measured), and the ledger's blame on the culprits in the run with it minus in the run
    without it (blamed); per control (a chat before the first culprit), its time in run 1
    minus in run 0. Summed per pair and over pairs."""
    chats = [p for p in planned if p.traffic_class == "chat"]

    def complete(p: Planned, pair: dict[str, Any]) -> bool:
        return all(p.index in pair[f"run{q}"]["times"] for q in (0, 1)) and all(
            p.index in pair[f"run{q}"]["blame"] for q in (0, 1)
        )

    # the same chats in every pair: those every run served and stored
    kept = [p for p in chats if all(complete(p, pair) for pair in pairs)]
    victims = [p for p in kept if p.episode is not None]
    controls = [p for p in kept if p.episode is None]
    per_pair = []
    per_victim: dict[str, dict[str, Any]] = {
        str(p.index): {
            "episode": p.episode,
            "with": [],
            "without": [],
            "blamed_with": [],
            "blamed_without": [],
        }  # fmt: skip
        for p in victims
    }
    split: dict[str, dict[str, float]] = {
        side: dict.fromkeys(("victims", "measured_ms", "blamed_ms", "own_ms", "pause_ms",
                             "others_ms"), 0.0)
        for side in ("reached", "not_reached")
    }  # fmt: skip
    for pair in pairs:
        measured = blamed = stray = 0.0
        for p in victims:
            with_run = pair[f"run{(p.episode or 0) % 2}"]
            without_run = pair[f"run{1 - (p.episode or 0) % 2}"]
            row = per_victim[str(p.index)]
            row["with"].append(with_run["times"][p.index])
            row["without"].append(without_run["times"][p.index])
            row["blamed_with"].append(with_run["blame"][p.index])
            row["blamed_without"].append(without_run["blame"][p.index])
            measured += with_run["times"][p.index] - without_run["times"][p.index]
            blamed += with_run["blame"][p.index] - without_run["blame"][p.index]
            # a neighbouring culprit (the other run's) that reached this one's victims
            stray += without_run["blame"][p.index]
            _split(split, p.index, with_run, without_run)
        drift = sum(pair["run1"]["times"][p.index] - pair["run0"]["times"][p.index]
                    for p in controls)  # fmt: skip
        per_pair.append(
            {
                "first_run": pair["first"],
                "measured_ms": measured,
                "blamed_ms": blamed,
                "blamed_over_measured": blamed / measured if measured > 0 else None,
                "blamed_in_runs_without_ms": stray,
                "controls_run1_minus_run0_ms": drift,
                **{
                    f"run{q}": {
                        k: v
                        for k, v in pair[f"run{q}"].items()
                        if k not in ("times", "blame", "parts")
                    }
                    for q in (0, 1)
                },  # fmt: skip
            }
        )
    measured = sum(p["measured_ms"] for p in per_pair)
    blamed = sum(p["blamed_ms"] for p in per_pair)
    ratio = blamed / measured if measured > 0 else None
    return {
        "num_victims": len(victims),
        "num_controls": len(controls),
        "num_chats_dropped": len(chats) - len(kept),
        "measured_ms": measured,
        "blamed_ms": blamed,
        "blamed_over_measured": ratio,
        "within_20pct": ratio is not None and abs(ratio - 1) <= 0.2,
        "per_pair": per_pair,
        "where_it_went": split,
        "per_victim_ms": per_victim,
    }


def _split(
    split: dict[str, dict[str, float]],
    i: int,
    with_run: dict[str, Any],
    without_run: dict[str, Any],
) -> None:
    """Add one victim's difference between its runs, part by part (the ledger's own work,
    pauses, the culprits' blame and the other requests' shares), to the victims its culprit
    reached (some blame on it) or to the others."""
    w, wo = with_run["parts"][i], without_run["parts"][i]
    bw, bwo = with_run["blame"][i], without_run["blame"][i]
    side = split["reached" if bw >= 1.0 else "not_reached"]
    side["victims"] += 1
    side["measured_ms"] += with_run["times"][i] - without_run["times"][i]
    side["blamed_ms"] += bw - bwo
    side["own_ms"] += w["own"] - wo["own"]
    side["pause_ms"] += w["pause"] - wo["pause"]
    side["others_ms"] += (w["excess"] - bw) - (wo["excess"] - bwo)


def run_mix(url: str, db: Any, mix: Mix, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """``args.pairs`` crossover pairs of the same schedule at the mix's budget."""
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
    return {
        "mix": mix.__dict__,
        "seed": seed,
        "pairs": args.pairs,
        "num_culprits": sum(1 for p in planned if p.traffic_class == "rag"),
        **summarize_pairs(planned, pairs),
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
    ap.add_argument("--pairs", type=int, default=6, help="crossover pairs of runs, per mix")
    ap.add_argument("--chat-every-s", type=float, default=1.5)
    ap.add_argument("--chat-output", type=int, default=40)
    ap.add_argument("--rag-first-s", type=float, default=3.0)
    ap.add_argument("--rag-every-s", type=float, default=8.0)
    ap.add_argument("--rag-output", type=int, default=4)
    ap.add_argument(
        "--victims-before-s",
        type=float,
        default=1.0,
        help="a culprit's victims: the chats sent from this long before it (until this long "
        "before the next culprit)",
    )
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
                    keys = ("mix", "num_victims", "measured_ms", "blamed_ms",
                            "blamed_over_measured")  # fmt: skip
                    print(json.dumps({x: res[x] for x in keys}), flush=True)
                    for p in res["per_pair"]:
                        print(json.dumps({x: p[x] for x in list(p)[:6]}), flush=True)
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
