"""Dashboard benchmarks (issue 9).

1. Refresh cost: one Live-page refresh (what the ``st.fragment`` does every second: the engines
   row, new steps by ``after_step``, new token ITLs by ``after_time``, the window's budget
   changes and latency summary, the four figures built and serialised to JSON) on a SQLite store
   of ``--steps`` steps (default one million, built once through ``storage.store.Store`` from
   ``testkit.engines.SyntheticEngine`` and kept in ``--store``), after each second of new data.
   Target: under 300 ms.
2. Step end to Live page: a collector subprocess, ``engine.telemetry.Publisher`` publishing a
   step every ``--step-ms`` in real time (16 streams decoding), and two readers running the Live
   page's read (``dashboard.live.LiveWindow.refresh``): one polling every 50 ms (the pipeline:
   publisher linger, collector commit, read) and one every ``--refresh-s`` (the page's
   ``run_every``), recording for every step the wall time between its end and the read that
   first returned it. Target: under 1 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import add_common_args, config_of, setup, write_json  # noqa: E402

SCRIPT = "bench_dashboard.py"


def _ms(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))] * 1e3

    return {
        "n": len(s),
        "median_ms": statistics.median(s) * 1e3,
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "max_ms": s[-1] * 1e3,
        "min_ms": s[0] * 1e3,
    }


# --- 1. refresh cost -----------------------------------------------------------------------------
def build_store(path: Path, num_steps: int, *, batch_steps: int = 5000) -> dict[str, Any]:
    """A store of ``num_steps`` synthetic steps (16 requests in flight, budget changes every
    100,000 steps), reused when the file already holds them."""
    from storage import db, queries
    from storage.store import Events, Hello, Store
    from testkit.engines import SyntheticEngine

    url = f"sqlite:///{path}"
    if path.exists():
        eng = queries.engines(db.connect(url, readonly=True))
        if not eng.empty and int(eng["num_steps"].sum()) >= num_steps:
            return {"url": url, "built_s": None, "reused": True, "bytes": path.stat().st_size}
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = db.connect(url)
    db.migrate(engine)
    store = Store(engine)
    # steps 10 ms apart ending about now, so the newest data is "live"
    step_ns = 10_000_000
    wall_ns = time.time_ns() - num_steps * step_ns * 5 // 4
    syn = SyntheticEngine(
        engine_id="engine-bench", run_id="run-bench-1M", concurrency=16, step_ns=step_ns,
        wall_ns=wall_ns, token_budget=512,
    )  # fmt: skip
    info = store.apply([Hello(syn.hello())])[0]
    t0 = time.perf_counter()
    done = 0
    while done < num_steps:
        n = min(batch_steps, num_steps - done)
        if done and done % 100_000 == 0:
            syn.control("token_budget", 256 if syn.token_budget == 512 else 512, source="bench")
        store.apply([Events(info.run_key, syn.steps(n))])
        done += n
        if done % 100_000 == 0:
            print(f"  store: {done} steps ({time.perf_counter() - t0:.0f} s)", flush=True)
    store.close()
    return {
        "url": url,
        "built_s": time.perf_counter() - t0,
        "reused": False,
        "bytes": path.stat().st_size,
    }


def live_refresh(q: Any, ro: Any, lw: Any, cache: dict[str, Any]) -> dict[str, float]:
    """Exactly the Live page's one-second fragment (reads and figures), timed by part; and,
    timed apart, its five-second latency fragment when that one would run (its window start on
    a 5 s grid moved: the page's ``st.cache_data`` key)."""
    from dashboard import charts
    from dashboard.live import SUMMARY_GRID_S

    t0 = time.perf_counter()
    eng = q.engines(ro)
    row = eng[eng["run_id"] == lw.run_ids[0][1]].iloc[0]
    t1 = time.perf_counter()
    lw.refresh(q, ro, latest=float(row["last_time"]))
    t2 = time.perf_counter()
    lo = SUMMARY_GRID_S * (lw.window()[0] // SUMMARY_GRID_S)
    rid = lw.run_ids[0][1]
    ctrl = q.controls(ro, engine_id=lw.engine_id, run_id=rid, since=lo)
    t3 = time.perf_counter()
    for fig in (
        charts.step_tokens_figure(lw.steps, ctrl),
        charts.itl_figure(lw.itl, ctrl),
        charts.kv_queue_figure(lw.steps, ctrl),
    ):
        fig.to_json()  # what st.plotly_chart sends
    t4 = time.perf_counter()
    if cache.get("since") != lo:
        summary = q.latency_summary(ro, engine_id=lw.engine_id, run_id=rid, since=lo)
        charts.latency_figure(summary).to_json()
        cache.setdefault("summary_s", []).append(time.perf_counter() - t4)
        cache["since"] = lo
    return {
        "total": t4 - t0,
        "engines": t1 - t0,
        "steps_and_itl": t2 - t1,
        "controls": t3 - t2,
        "figures": t4 - t3,
    }


def bench_refresh(args: argparse.Namespace) -> dict[str, Any]:
    from dashboard.live import LiveWindow
    from storage import db
    from storage import queries as q
    from storage.store import Events, Hello, Store
    from testkit.engines import SyntheticEngine

    built = build_store(Path(args.store), args.steps)
    url = built["url"]
    # The page follows a live run: a new engine run in this big store, one window of steps
    # first, then one second of steps (100 at 10 ms) before each timed refresh.
    step_ns = 10_000_000
    per_refresh = 100
    window_steps = int(args.window * 1e9 // step_ns)
    total = window_steps + (args.refreshes + 1) * per_refresh
    live = SyntheticEngine(
        engine_id="engine-live", run_id=f"run-live-{time.time_ns()}", concurrency=16,
        step_ns=step_ns, wall_ns=time.time_ns() - total * step_ns * 5 // 4, token_budget=512,
    )  # fmt: skip
    writer = Store(db.connect(url))
    run_key = writer.apply([Hello(live.hello())])[0].run_key
    writer.apply([Events(run_key, live.steps(window_steps))])
    ro = db.connect(url, readonly=True)
    lw = LiveWindow(engine_id=live.engine_id, run_ids=((live.engine_id, live.run_id),))
    lw.window_s = args.window
    cache: dict[str, Any] = {}
    cold = live_refresh(q, ro, lw, cache)
    window_rows = {"steps": len(lw.steps), "itl": len(lw.itl)}
    samples: list[dict[str, float]] = []
    for i in range(args.refreshes):
        if i == args.refreshes // 2:
            live.control("token_budget", 256, source="bench")  # a marker in the window
        writer.apply([Events(run_key, live.steps(per_refresh))])
        samples.append(live_refresh(q, ro, lw, cache))
    writer.close()
    parts = {k: _ms([s[k] for s in samples]) for k in samples[0]}
    eng = q.engines(ro)
    return {
        "store": built,
        "num_steps_in_store": int(eng["num_steps"].sum()),
        "window_s": args.window,
        "live_run": {"step_ms": step_ns / 1e6, "requests_in_flight": 16},
        "window_rows_first_read": window_rows,
        "cold_first_refresh_ms": {k: v * 1e3 for k, v in cold.items()},
        "new_data_between_refreshes": f"{per_refresh} steps (1 s)",
        "refresh": parts,
        "latency_fragment": _ms(cache.get("summary_s", [])[1:]),
        "target_ms": 300,
    }


# --- 2. step end to Live page -------------------------------------------------------------------
def bench_latency(args: argparse.Namespace) -> dict[str, Any]:
    from dashboard.live import LiveWindow
    from engine.telemetry.publisher import Publisher
    from storage import db
    from storage import queries as q
    from testkit.collector import start_collector
    from wire.events import ChunkRecord, RequestEvent, StepEvent

    tmp = Path(tempfile.mkdtemp(prefix="chunkscope-bench-dash-"))
    url = f"sqlite:///{tmp / 'live.db'}"
    collector = start_collector(url)
    anchor_wall, anchor_mono = time.time_ns(), time.monotonic_ns()
    streams = 16

    def hello() -> dict[str, Any]:
        return {
            "model": "synthetic", "host": "bench", "pid": os.getpid(), "policy": "chunked",
            "token_budget": 512, "max_token_budget": 8192, "kv_blocks_total": 1024,
            "block_size": 16, "config": {},
            "clock": {"wall_ns": anchor_wall, "mono_ns": anchor_mono},
        }  # fmt: skip

    pub = Publisher(collector.url, engine_id="engine-live", hello=hello).start()
    ends: dict[int, float] = {}  # step -> wall time of its end
    seen: dict[str, dict[int, float]] = {"poll_50ms": {}, "page": {}}
    stop = threading.Event()

    def reader(name: str, period: float) -> None:
        ro = db.connect(url, readonly=True)
        lw: LiveWindow | None = None
        while not stop.is_set():
            t = time.perf_counter()
            try:
                eng = q.engines(ro)
                if not eng.empty:
                    if lw is None:
                        lw = LiveWindow(
                            engine_id="engine-live",
                            run_ids=(("engine-live", str(eng.iloc[0]["run_id"])),),
                        )
                    lw.refresh(q, ro, latest=None)
                    now = time.time()
                    for s in lw.steps["step"].tolist() if lw.steps is not None else []:
                        seen[name].setdefault(int(s), now)
            except Exception as exc:  # noqa: BLE001 - the store may not exist for a moment
                if "no such table" not in str(exc):
                    print(f"  {name}: {exc}", file=sys.stderr)
            time.sleep(max(0.0, period - (time.perf_counter() - t)))

    threads = [
        threading.Thread(target=reader, args=("poll_50ms", 0.05), daemon=True),
        threading.Thread(target=reader, args=("page", args.refresh_s), daemon=True),
    ]
    for t in threads:
        t.start()
    for i in range(streams):
        rid = f"chat-{i}"
        pub.publish(RequestEvent("arrived", rid, time.monotonic_ns(), "chat", 32, step=0))
    step = 0
    deadline = time.monotonic() + args.latency_seconds
    while time.monotonic() < deadline:
        start = time.monotonic_ns()
        time.sleep(args.step_ms / 1000)
        end = time.monotonic_ns()
        chunks = [ChunkRecord(f"chat-{i}", "decode", 32 + step, 1, True) for i in range(streams)]
        pub.publish(
            StepEvent(
                step=step, start_ns=start, end_ns=end, token_budget=512, policy="chunked",
                num_decode_tokens=streams, num_prefill_tokens=0, num_scheduled_tokens=streams,
                num_running=streams, num_waiting=0, kv_blocks_used=streams * 4,
                kv_blocks_total=1024, num_preemptions=0, chunks=chunks,
                forward_ns=end - start,
            )
        )  # fmt: skip
        ends[step] = (anchor_wall + end - anchor_mono) / 1e9
        step += 1
    time.sleep(max(2.0, 2 * args.refresh_s))
    stop.set()
    for t in threads:
        t.join(10)
    pub.close()
    collector.stop()
    out: dict[str, Any] = {"steps_published": step, "step_ms": args.step_ms}
    for name, got in seen.items():
        lat = [got[s] - ends[s] for s in ends if s in got]
        out[name] = {**_ms(lat), "steps_seen": len(lat)}
    out["page"]["refresh_s"] = args.refresh_s
    out["target_ms"] = 1000
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--steps", type=int, default=1_000_000, help="steps in the refresh store")
    ap.add_argument(
        "--store",
        default=str(Path(tempfile.gettempdir()) / "chunkscope-bench-dashboard" / "store.db"),
        help="SQLite file for the refresh store (built when missing or too small, then reused)",
    )
    ap.add_argument("--window", type=float, default=60.0, help="Live window in seconds")
    ap.add_argument("--refreshes", type=int, default=30, help="timed refreshes")
    ap.add_argument("--latency-seconds", type=float, default=30.0, help="real-time run length")
    ap.add_argument("--step-ms", type=float, default=20.0, help="one published step every N ms")
    ap.add_argument("--refresh-s", type=float, default=1.0, help="the Live page's run_every")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.refreshes, args.latency_seconds = 20_000, 5, 5.0
        if args.store == ap.get_default("store"):
            args.store = str(Path(args.store).with_name("store-quick.db"))
    out_dir = setup(args)
    print(f"refresh cost on a {args.steps}-step store ...", flush=True)
    refresh = bench_refresh(args)
    r = refresh["refresh"]["total"]
    print(f"  one Live refresh: median {r['median_ms']:.1f} ms, p90 {r['p90_ms']:.1f} ms")
    print("step end to Live page ...", flush=True)
    latency = bench_latency(args)
    for name in ("poll_50ms", "page"):
        m = latency[name]
        print(f"  {name}: median {m.get('median_ms', 0):.0f} ms, p99 {m.get('p99_ms', 0):.0f} ms")
    write_json(
        out_dir / "dashboard.json",
        {"refresh": refresh, "latency": latency},
        script=SCRIPT,
        config=config_of(args),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
