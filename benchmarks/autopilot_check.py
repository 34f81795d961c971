"""Does a tick's prediction for the setting the engine runs match what the store saw? Offline, on
any store (the dashboard's ``data/chunkscope.db``, a kept benchmark store), no decision log
needed.

Every ``--every`` seconds of the store's traffic where one (budget, cap) ran through the whole
look-back, the autopilot's own tick is redone at that moment ``t`` (``advisor.autopilot_run``):
the step-cost model fitted on the last ``--fit-window`` seconds, the scatter of the last
``--noise-window`` seconds, the look-back's requests (``recent_traffic``) replayed at the running
setting, median of ``--draws`` draws, against ``observed`` (chat ITL p99 and TTFT p99 of the same
requests as far as the store had them at ``t``). Arms, on the same moments and draws:

- ``before``: the code before issue 19's last session: the scatter and pauses kept as quantiles
  ``0, 1/199, ..., 1`` (the maximum one draw in 200), the look-back starting wherever
  ``t - lookback`` fell (mid-step included) and its backlog replayed from its first prompt token;
- ``quantiles``: equal-mass quantiles (``advisor.quantiles``), the look-back as ``before``;
- ``now``: equal-mass quantiles, the look-back starting at a step boundary
  (``lookback_start``) and the backlog replayed from its prefill progress
  (``prefill_progress``): the autopilot as it is.

Per store and arm: the median |relative error| and the share within 15% (the issue's target).

    .venv/bin/python -m benchmarks.autopilot_check --store data/chunkscope.db [--store ...]

Writes ``autopilot_check.json`` (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import add_common_args, config_of, setup, write_json
from benchmarks.advisor import median_present, rel_err

SCRIPT = "autopilot_check.py"
ARMS = ("before", "quantiles", "now")
FIGURES = ("itl", "ttft")


def endpoint_quantiles(values: Sequence[float] | np.ndarray, k: int) -> list[float]:
    """The quantiles ``0, 1/(k-1), ..., 1`` the fit kept before (the ``before`` arm)."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return []
    qs = np.linspace(0, 1, k)
    return [float(v) for v in np.quantile(a, qs, method="inverted_cdf")]


@contextmanager
def arm_code(arm: str) -> Iterator[None]:
    """The advisor as ``arm`` has it (module functions swapped for the arm's, then restored)."""
    import advisor.autopilot_run as ar
    import advisor.fit as fit

    saved = (fit.mass_quantiles, ar.prefill_progress)
    try:
        if arm == "before":
            fit.mass_quantiles = endpoint_quantiles  # type: ignore[assignment]
        if arm in ("before", "quantiles"):
            ar.prefill_progress = lambda *a, **k: {}  # type: ignore[assignment]
        yield
    finally:
        fit.mass_quantiles, ar.prefill_progress = saved  # type: ignore[assignment]


def check_engine(db: Any, engine_id: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every ``--every`` seconds of one engine's traffic, each arm's tick against the store."""
    from advisor.autopilot import AutopilotSlo
    from advisor.traffic import engine_shape
    from storage import queries

    steps = queries.steps(db, engine_id=engine_id)
    busy = steps[steps["num_scheduled_tokens"] > 0]
    if busy.empty:
        return {"engine_id": engine_id, "moments": [], "summary": {}}
    shape = engine_shape(db, engine_id=engine_id)
    slo = AutopilotSlo(args.slo_itl_ms, args.slo_ttft_ms)
    cap = steps["long_prefill_token_threshold"].fillna(0).astype(int)
    t0, t1 = float(busy["start"].min()), float(busy["end"].max())
    rows: list[dict[str, Any]] = []
    t = t0 + args.lookback + args.warmup
    while t <= t1:
        row = _moment(db, engine_id, t, args, shape, slo, steps, cap)
        if row is not None:
            rows.append(row)
            print(
                f"  {engine_id} t+{row['t_s']:.0f}s {row['setting']}: observed ITL p99 "
                f"{row['observed'][0]:.0f} ms, TTFT p99 {row['observed'][1]:.0f} ms; "
                + "; ".join(
                    f"{a} {row[a]['predicted'][0]:.0f}/{row[a]['predicted'][1]:.0f}" for a in ARMS
                ),
                flush=True,
            )
        t += args.every
    return {"engine_id": engine_id, "moments": rows, "summary": summarize(rows)}


def _moment(
    db: Any,
    engine_id: str,
    t: float,
    args: argparse.Namespace,
    shape: Any,
    slo: Any,
    steps: Any,
    cap: Any,
) -> dict[str, Any] | None:
    """Each arm's tick at ``t`` (None where the look-back ran more than one setting or holds
    too few requests, or no fit can be made)."""
    from advisor.autopilot import Setting, predict_settings
    from advisor.autopilot_run import lookback_start, observed, recent_traffic
    from advisor.fit import FitError, fit_from_store, load_steps, with_recent_noise

    raw = t - args.lookback
    aligned = lookback_start(db, engine_id=engine_id, run_id=None, since=raw)
    span = (steps["end"] > aligned) & (steps["start"] <= t)
    settings = set(zip(steps.loc[span, "token_budget"], cap[span], strict=True))
    if len(settings) != 1:
        return None
    budget, cap_value = settings.pop()
    setting = Setting(int(budget), int(cap_value))
    row: dict[str, Any] = {"t_s": round(t - args.t0, 2), "setting": setting.label()}
    recent = load_steps(db, engine_id=engine_id, since=t - args.noise_window, until=t)
    # the arms share work: "quantiles" and "now" fit alike, "before" and "quantiles" read the
    # same window; each is done once
    fits: dict[bool, Any] = {}
    windows: dict[bool, tuple[Any, Any]] = {}
    for arm in ARMS:
        old_fit, new_window = arm == "before", arm == "now"
        since = aligned if new_window else raw
        with arm_code(arm):
            if old_fit not in fits:
                try:
                    fit = fit_from_store(
                        db, engine_id=engine_id, since=t - args.fit_window, until=t, resamples=0
                    )
                except FitError:
                    return None
                if args.noise_window > 0:
                    fit, _ = with_recent_noise(fit, recent)
                fits[old_fit] = fit
            if new_window not in windows:
                traffic = recent_traffic(db, engine_id=engine_id, run_id=None, since=since, until=t)
                obs = observed(
                    db, engine_id=engine_id, run_id=None, since=since, until=t, steady=True
                )
                windows[new_window] = (traffic, obs)
        fit, (traffic, obs) = fits[old_fit], windows[new_window]
        if len(traffic.requests) < args.min_requests:
            return None
        if not obs.itl_p99_ms or not obs.ttft_p99_ms:
            return None
        draws = [
            predict_settings(fit, traffic, shape, [setting], slo, seed=args.seed + k)[0]
            for k in range(args.draws)
        ]
        pred = [
            median_present([p.itl_seen_p99_ms for p in draws]),
            median_present([p.ttft_seen_p99_ms for p in draws]),
        ]
        row["observed"] = [obs.itl_p99_ms, obs.ttft_p99_ms]  # the last arm's ("now")
        row[arm] = {
            "since_shift_s": round(since - raw, 3),
            "num_requests": len(traffic.requests),
            "predicted": pred,
            "observed": [obs.itl_p99_ms, obs.ttft_p99_ms],
            "itl_error": rel_err(pred[0], obs.itl_p99_ms),
            "ttft_error": rel_err(pred[1], obs.ttft_p99_ms),
        }
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and figure: moments, median |relative error|, share within 15%."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        out[arm] = {}
        for fig in FIGURES:
            errs = np.array(
                [r[arm][f"{fig}_error"] for r in rows if r[arm][f"{fig}_error"] is not None],
                dtype=float,
            )
            out[arm][fig] = {
                "num_moments": int(errs.size),
                "median_error": float(np.median(errs)) if errs.size else None,
                "within_15pct": float(np.mean(errs <= 0.15)) if errs.size else None,
            }
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument("--store", action="append", required=True, help="a SQLite store (repeatable)")
    ap.add_argument("--engine", action="append", help="engine ids to check (default: all)")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between moments")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of traffic skipped")
    ap.add_argument("--lookback", type=float, default=20.0, help="the autopilot's --lookback")
    ap.add_argument("--fit-window", type=float, default=120.0, help="its --fit-window")
    ap.add_argument("--noise-window", type=float, default=30.0, help="its --noise-window")
    ap.add_argument("--draws", type=int, default=5, help="draws per prediction (median)")
    ap.add_argument("--min-requests", type=int, default=5, help="its fewest requests to decide")
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    from storage import db as dbm
    from storage import queries

    ap = build_parser()
    args = ap.parse_args(argv)
    if args.every <= 0 or args.lookback <= 0 or args.draws < 1 or args.fit_window <= 0:
        ap.error("--every, --lookback and --fit-window must be positive, --draws >= 1")
    stores = [Path(s) for s in args.store]
    for s in stores:
        if not s.is_file():
            ap.error(f"--store {s}: no such file")
    out_dir = setup(args)
    results = []
    for s in stores:
        db = dbm.connect(f"sqlite:///{s.resolve()}", readonly=True)
        try:
            engines = [str(e) for e in queries.engines(db)["engine_id"].unique()]
            for eid in [e for e in engines if not args.engine or e in args.engine]:
                st = queries.steps(db, engine_id=eid)
                args.t0 = float(st["start"].min()) if not st.empty else 0.0
                r = check_engine(db, eid, args)
                results.append({"store": str(s), **r})
                print(f"{s} {eid}: " + _line(r["summary"]), flush=True)
        finally:
            db.dispose()
    if not any(r["moments"] for r in results):
        ap.error("no moment with one setting through a look-back and enough requests")
    pooled = summarize([m for r in results for m in r["moments"]])
    print("all: " + _line(pooled))
    cfg = {k: v for k, v in config_of(args).items() if k != "t0"}
    write_json(
        out_dir / "autopilot_check.json",
        {"runs": results, "pooled": pooled},
        script=SCRIPT,
        config=cfg,
    )
    return 0


def _line(summary: dict[str, Any]) -> str:
    parts = []
    for arm in ARMS:
        s = summary.get(arm)
        if not s or s["itl"]["median_error"] is None:
            continue
        parts.append(
            f"{arm}: ITL p99 {s['itl']['median_error']:.0%} "
            f"({s['itl']['within_15pct']:.0%} within 15%), TTFT p99 "
            f"{s['ttft']['median_error']:.0%} ({s['ttft']['within_15pct']:.0%}) "
            f"over {s['itl']['num_moments']}"
        )
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
