"""Do the autopilot's predictions hold on its own windows when made from what came before them?
Offline, on the stores and decision logs ``benchmarks/autopilot.py --keep-store`` keeps.

The autopilot replays the requests of its look-back at each setting and takes the result for
what the next window will do. Its benchmark compares each tick's prediction for the setting in
force with what the client measured on the same requests; but that prediction drew the step
times' scatter from steps that include the window's own, so it is partly a fit to the window.
This script makes the prediction from earlier data only, and so measures the model as a
forecast of the step times:

for each logged tick at ``t`` whose look-back ran one setting (the log's ``observed.steady``),
the window ``[s, t]`` is replayed at that setting, ``s`` the start of the step in flight at
``t - L`` (``L`` = ``--lookback``; ``advisor.autopilot_run.lookback_start``, as the autopilot
starts its look-back), with

- the step-cost model fitted on ``[s - fit_window, s]`` (``advisor.fit.fit_from_store``),
- the scatter and pauses of ``[s - W, s]`` for each ``W`` of ``--noise-windows``
  (``advisor.fit.with_recent_noise``; ``W = 0``: the fit window's own, as before
  ``--noise-window`` existed),
- the window's own requests (``advisor.autopilot_run.recent_traffic``),

and its chat ITL p99 and TTFT p99, as far as the store could have seen them at ``t``, are
compared with what the store saw (``advisor.autopilot_run.observed``). Per log and per ``W``:
the median |relative error| and the share of ticks within 15%.

    .venv/bin/python -m benchmarks.autopilot_nowcast --store DIR/store.db [--store ...]

Writes ``autopilot_nowcast.json`` (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import add_common_args, config_of, setup, write_json
from benchmarks.advisor import rel_err

SCRIPT = "autopilot_nowcast.py"


def replay_log(
    db: Any, log: Path, args: argparse.Namespace, windows: list[float]
) -> dict[str, Any]:
    """Every ``--stride``-th steady tick of one decision log, predicted at each noise window."""
    from advisor.autopilot import AutopilotSlo, Setting, predict_settings
    from advisor.autopilot_run import lookback_start, observed, recent_traffic
    from advisor.fit import FitError, fit_from_store, load_steps, with_recent_noise
    from advisor.traffic import engine_shape
    from storage import queries

    engines = queries.engines(db)
    eid, rid = str(engines["engine_id"].iloc[-1]), str(engines["run_id"].iloc[-1])
    shape = engine_shape(db, engine_id=eid, run_id=rid)
    slo = AutopilotSlo(args.slo_itl_ms, args.slo_ttft_ms, None, {})
    ticks = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    t0 = ticks[0]["time"] if ticks else 0.0
    rows = []
    for d in ticks[:: args.stride]:
        if not d.get("observed", {}).get("steady", False):
            continue
        t = float(d["time"])
        # where the tick's look-back starts (the start of the step in flight then)
        lo = lookback_start(db, engine_id=eid, run_id=rid, since=t - args.lookback)
        setting = Setting(int(d["previous_budget"]), int(d["previous_cap"]))
        traffic = recent_traffic(db, engine_id=eid, run_id=rid, since=lo, until=t)
        if len(traffic.requests) < args.min_requests:
            continue
        obs = observed(db, engine_id=eid, run_id=rid, since=lo, until=t, steady=True)
        if not obs.itl_p99_ms or not obs.ttft_p99_ms:
            continue
        try:
            fit = fit_from_store(
                db, engine_id=eid, run_id=rid, since=lo - args.fit_window, until=lo, resamples=0
            )
        except FitError:
            continue
        row: dict[str, Any] = {
            "t_s": round(t - t0, 2),
            "setting": setting.label(),
            "num_requests": len(traffic.requests),
            "observed": [obs.itl_p99_ms, obs.ttft_p99_ms],
        }
        for w in windows:
            report, n = fit, 0
            if w > 0:
                steps = load_steps(db, engine_id=eid, run_id=rid, since=lo - w, until=lo)
                report, n = with_recent_noise(fit, steps)
            p = predict_settings(report, traffic, shape, [setting], slo, seed=args.seed)[0]
            row[f"W{w:g}"] = {
                "predicted": [p.itl_seen_p99_ms, p.ttft_seen_p99_ms],
                "noise_steps": n,
                "itl_error": rel_err(p.itl_seen_p99_ms, obs.itl_p99_ms),
                "ttft_error": rel_err(p.ttft_seen_p99_ms, obs.ttft_p99_ms),
            }
        rows.append(row)
    summary = {}
    for w in windows:
        key = f"W{w:g}"
        summary[key] = {}
        for fig in ("itl_error", "ttft_error"):
            errs = np.array([r[key][fig] for r in rows if r[key][fig] is not None], dtype=float)
            summary[key][fig] = {
                "num_ticks": int(errs.size),
                "median": float(np.median(errs)) if errs.size else None,
                "within_15pct": float(np.mean(errs <= 0.15)) if errs.size else None,
            }
    return {"log": log.name, "engine_id": eid, "summary": summary, "ticks": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument(
        "--store",
        action="append",
        required=True,
        help="a kept store (repeatable); its decisions-*.jsonl beside it are replayed",
    )
    ap.add_argument("--noise-windows", default="0,30", help="seconds, comma-separated (0: none)")
    ap.add_argument("--lookback", type=float, default=10.0, help="the run's --ap-lookback")
    ap.add_argument("--fit-window", type=float, default=180.0, help="the run's --ap-fit-window")
    ap.add_argument("--stride", type=int, default=2, help="every N-th logged tick")
    ap.add_argument("--min-requests", type=int, default=3)
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    from sqlalchemy import create_engine

    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        windows = [float(x) for x in args.noise_windows.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--noise-windows: numbers, comma-separated, got {args.noise_windows!r}")
    if not windows or min(windows) < 0 or args.stride < 1:
        ap.error("--noise-windows must be >= 0 and --stride >= 1")
    stores = [Path(s) for s in args.store]
    for s in stores:
        if not s.is_file():
            ap.error(f"--store {s}: no such file")
        if not list(s.parent.glob("decisions-*.jsonl")):
            ap.error(f"--store {s}: no decisions-*.jsonl beside it (kept since --keep-store)")
    out_dir = setup(args)
    runs = []
    for s in stores:
        db = create_engine(f"sqlite:///{s.resolve()}")
        for log in sorted(s.parent.glob("decisions-*.jsonl")):
            r = replay_log(db, log, args, windows)
            runs.append({"store": str(s), **r})
            line = " | ".join(
                f"W{w:g}: ITL p99 {_fmt(r['summary'][f'W{w:g}']['itl_error'])}, "
                f"TTFT p99 {_fmt(r['summary'][f'W{w:g}']['ttft_error'])}"
                for w in windows
            )
            print(f"{s.parent.name}/{log.name}: {line}", flush=True)
    write_json(
        out_dir / "autopilot_nowcast.json",
        {"runs": runs},
        script=SCRIPT,
        config=config_of(args),
    )
    return 0


def _fmt(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "n/a"
    return f"{s['median']:.0%} ({s['within_15pct']:.0%} within 15%, {s['num_ticks']} ticks)"


if __name__ == "__main__":
    sys.exit(main())
