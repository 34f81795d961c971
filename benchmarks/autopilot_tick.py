"""What one autopilot tick costs in CPU, offline, on a kept store; and the same ticks under
another git revision, alternated in one run, with a check that both predict the same.

A tick (``advisor.autopilot_run.Runner.tick``) reads the store, refits the step-cost model at
most every ``--refit-every`` seconds, and replays the look-back's requests through the engine's
scheduler at every candidate setting (``advisor.autopilot.predict_settings``). On a two-core
machine that CPU is taken from the engine it steers (``--max-cpu-share``; docs/architecture.md,
"Its own cost"). This script replays a store's ticks every ``--every`` seconds of its traffic
and times each part with ``time.process_time``:

- ``reads``: the queries of a tick (traffic, observations, shape, load, foreign controls);
- ``fit``: ``advisor.fit.fit_from_store`` over ``--fit-window`` seconds (counted once per
  ``--refit-every`` seconds of ticks, as the runner does);
- ``noise``: the scatter of the last ``--noise-window`` seconds of steps
  (``advisor.fit.with_recent_noise``; 0 in a revision without it);
- ``simulate``: ``predict_settings`` at every candidate (the CLI's default grid unless
  ``--budgets``/``--caps``).

With ``--against REV`` the same ticks also run with REV's packages (a temporary detached
``git worktree``; the measurement runs in a subprocess whose ``PYTHONPATH`` is that tree),
``--rounds`` times each, alternated, and the result reports the ratio of the medians per part
and whether every tick's predictions are identical (a speed-up that changes a prediction is a
change of the model, and says so).

Stores: ``python -m benchmarks.autopilot --keep-store DIR/store.db`` keeps one; so does the
dashboard (``data/chunkscope.db``).

    .venv/bin/python -m benchmarks.autopilot_tick --store DIR/store.db --against HEAD~1

Writes ``autopilot_tick.json`` (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPT = "autopilot_tick.py"
PARTS = ("reads", "fit", "noise", "simulate")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every tick's CPU per part and a digest of its predictions, with the packages on
    ``sys.path`` (this tree's, or the ``--against`` tree's in the subprocess)."""
    import numpy as np
    from sqlalchemy import create_engine

    from advisor.autopilot import AutopilotSlo, candidates, predict_settings
    from advisor.autopilot_run import (
        DEFAULT_BUDGETS,
        DEFAULT_CAPS,
        changed_since,
        foreign_control,
        observed,
        recent_traffic,
    )
    from advisor.fit import FitError, fit_from_store, load_steps

    try:
        from advisor.fit import with_recent_noise
    except ImportError:  # a revision from before it
        with_recent_noise = None
    try:
        from advisor.autopilot_run import lookback_start
    except ImportError:  # a revision from before it: the look-back started anywhere
        lookback_start = None
    from advisor.traffic import engine_shape, observed_load
    from storage import queries

    db = create_engine(f"sqlite:///{args.store}")
    engines = queries.engines(db)
    if engines.empty:
        raise SystemExit(f"{args.store}: no engine in this store")
    eid = args.engine or str(engines["engine_id"].iloc[-1])
    shape = engine_shape(db, engine_id=eid)
    budgets = _ints(args.budgets) if args.budgets else DEFAULT_BUDGETS
    caps = _ints(args.caps) if args.caps else DEFAULT_CAPS
    grid = candidates(budgets, caps, max_token_budget=shape.max_token_budget, cap_supported=True)
    slo = AutopilotSlo(args.slo_itl_ms, args.slo_ttft_ms, None, {})
    req = queries.requests(db, engine_id=eid)
    arrivals = req["arrival"].dropna()
    if arrivals.empty:
        raise SystemExit(f"{args.store}: engine {eid} served no request")
    lo, hi = float(arrivals.min()) + args.lookback, float(arrivals.max())
    ticks = []
    fit: Any = None
    fit_at = -1e18
    for now in np.arange(lo, hi, args.every)[: args.max_ticks]:
        now = float(now)
        c0 = time.process_time()
        since = now - args.lookback
        if lookback_start is not None:
            since = lookback_start(db, engine_id=eid, run_id=None, since=since)
        foreign_control(db, engine_id=eid, run_id=None, since=lo)
        traffic = recent_traffic(db, engine_id=eid, run_id=None, since=since, until=now)
        steady = not changed_since(db, engine_id=eid, run_id=None, since=since)
        observed(db, engine_id=eid, run_id=None, since=since, until=now, steady=steady)
        observed_load(db, engine_id=eid, run_id=None, since=since, until=now)
        engine_shape(db, engine_id=eid)
        c1 = time.process_time()
        fit_s = 0.0
        if now - fit_at >= args.refit_every:
            try:
                fit = fit_from_store(
                    db, engine_id=eid, since=now - args.fit_window, until=now, resamples=0
                )
            except FitError:
                fit = None
            fit_at, fit_s = now, time.process_time() - c1
        c2 = time.process_time()
        drawn = fit
        if fit is not None and with_recent_noise is not None and args.noise_window > 0:
            recent = load_steps(db, engine_id=eid, since=now - args.noise_window, until=now)
            drawn, _ = with_recent_noise(fit, recent)
        c25 = time.process_time()
        preds = [] if drawn is None else predict_settings(drawn, traffic, shape, grid, slo)
        c3 = time.process_time()
        figures = [
            [p.setting.label(), p.num_meet, p.itl_p99_ms, p.itl_max_ms, p.ttft_p99_ms]
            for p in preds
        ]
        ticks.append(
            {
                "t_s": round(now - lo, 3),
                "arrivals": len(traffic.requests),
                "reads": c1 - c0,
                "fit": fit_s,
                "noise": c25 - c2,
                "simulate": c3 - c25,
                "digest": hashlib.sha256(json.dumps(figures).encode()).hexdigest()[:16],
            }
        )
    import advisor

    return {
        "engine_id": eid,
        "num_settings": len(grid),
        "packages": str(Path(advisor.__file__).resolve().parent.parent),
        "ticks": ticks,
    }


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def totals(m: dict[str, Any]) -> dict[str, float]:
    return {p: sum(t[p] for t in m["ticks"]) for p in PARTS}


def run_under(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement with ``tree``'s packages first on the path."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--measure-to", f.name]
        cmd += _measure_args(args)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(cmd, env=env, cwd=tree, check=True)
        return json.loads(Path(f.name).read_text())


def _measure_args(args: argparse.Namespace) -> list[str]:
    out = ["--store", str(Path(args.store).resolve())]
    for name in (
        "engine", "every", "max_ticks", "lookback", "fit_window", "refit_every",
        "noise_window", "budgets", "caps", "slo_itl_ms", "slo_ttft_ms",
    ):  # fmt: skip
        v = getattr(args, name)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    return out


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """This tree against ``--against``, alternated ``--rounds`` times."""
    from benchmarks._common import REPO_ROOT

    tmp = Path(tempfile.mkdtemp(prefix="autopilot-tick-"))
    other = tmp / "tree"
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "-q", "--detach", str(other),
         args.against],
        check=True,
    )  # fmt: skip
    try:
        rev = subprocess.run(
            ["git", "-C", str(other), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        runs: dict[str, list[dict[str, Any]]] = {"this": [], "against": []}
        for _ in range(args.rounds):
            runs["this"].append(run_under(REPO_ROOT, args))
            runs["against"].append(run_under(other, args))
    finally:
        subprocess.run(
            ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(other)],
            check=False,
        )
        shutil.rmtree(tmp, ignore_errors=True)
    digests = {k: [[t["digest"] for t in m["ticks"]] for m in v] for k, v in runs.items()}
    med = {
        k: {p: statistics.median(totals(m)[p] for m in v) for p in PARTS} for k, v in runs.items()
    }
    first = runs["this"][0]
    return {
        "against": {"rev": args.against, "commit": rev},
        "engine_id": first["engine_id"],
        "num_settings": first["num_settings"],
        "num_ticks": len(first["ticks"]),
        "max_arrivals": max((t["arrivals"] for t in first["ticks"]), default=0),
        "identical_predictions": all(d == digests["this"][0] for v in digests.values() for d in v),
        "cpu_s_median": med,
        "speedup": {p: _ratio(med["against"][p], med["this"][p]) for p in PARTS},
        "runs": runs,
    }


def _ratio(a: float, b: float) -> float | None:
    """a / b; None where either is under 10 ms in all (a part one revision does not have)."""
    return a / b if min(a, b) >= 0.01 else None


def build_parser() -> argparse.ArgumentParser:
    from benchmarks._common import add_common_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    _measure_opts(ap)
    ap.add_argument("--against", help="a git revision to compare with, alternated in one run")
    ap.add_argument("--rounds", type=int, default=3)
    return ap


def _measure_opts(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--store", required=True, help="a SQLite store (a file path)")
    ap.add_argument("--engine", help="engine id (default: the store's last)")
    ap.add_argument("--every", type=float, default=2.0, help="seconds of traffic between ticks")
    ap.add_argument("--max-ticks", type=int, default=60)
    ap.add_argument("--lookback", type=float, default=10.0)
    ap.add_argument("--fit-window", type=float, default=180.0)
    ap.add_argument("--refit-every", type=float, default=10.0)
    ap.add_argument("--noise-window", type=float, default=30.0, help="0: the fit window's")
    ap.add_argument("--budgets", help="default: the autopilot CLI's")
    ap.add_argument("--caps", help="default: the autopilot CLI's")
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--measure-to" in argv:  # the subprocess: no benchmarks package needed from its tree
        here = Path(__file__).resolve().parent  # run as a file: its folder (benchmarks/advisor.py
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # is no package)
        ap = argparse.ArgumentParser()
        _measure_opts(ap)
        ap.add_argument("--measure-to", required=True)
        args = ap.parse_args(argv)
        Path(args.measure_to).write_text(json.dumps(measure(args)))
        return 0
    from benchmarks._common import config_of, setup, write_json

    ap = build_parser()
    args = ap.parse_args(argv)
    if not Path(args.store).is_file():
        ap.error(f"--store {args.store}: no such file")
    if args.rounds < 1 or args.every <= 0 or args.max_ticks < 1:
        ap.error("--rounds and --max-ticks must be >= 1, --every > 0")
    out_dir = setup(args)
    if args.against:
        result = compare(args)
        med, sp = result["cpu_s_median"], result["speedup"]
        for p in PARTS:
            print(
                f"{p:9s} this {med['this'][p]:7.2f} s  {args.against} {med['against'][p]:7.2f} s"
                f"  {'n/a' if sp[p] is None else f'x{sp[p]:.2f}'}"
            )
        print(f"identical predictions: {result['identical_predictions']}")
    else:
        m = measure(args)
        result = {**m, "cpu_s": totals(m)}
        print(json.dumps(result["cpu_s"]))
    write_json(out_dir / "autopilot_tick.json", result, script=SCRIPT, config=config_of(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
