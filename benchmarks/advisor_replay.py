"""The budget advisor's holdout check again, offline, on the stores of earlier runs.

``python -m benchmarks.advisor --workloads holdout --work-dir DIR`` keeps, per workload, the
collector's store (``WORKLOAD.db``), the baseline's loadgen result (``WORKLOAD-baseline.json``)
and the sweep's (``WORKLOAD-sweep.json``). This script refits each baseline window with the code
as it is now (``advisor.fit.fit_from_store``), and for every sweep window gives:

- **per step**: the window's recorded steps against the baseline fit's prediction, by shape
  (decode only, prefill, prefill of requests with images): median measured/predicted and median
  |relative error|. This is the cost model's carry from the fitted budget to the others, with
  no simulation in between;
- **per figure**: chat ITL p99, ITL max and TTFT p99 predicted from the window's own recorded
  arrivals (``benchmarks.advisor.replay``, median of ``--draws``), against the sweep's
  measurement, as ``advisor_holdout.json`` reports them;
- the fit's verdict (``fit_quality``, the resampling ``carry`` spreads per budget included,
  ``advisor.predict.fit_carry``) and whether the prediction recommends.

A model change is tried in seconds this way instead of in a 12-minute live sweep; it reuses
the same windows, so it cannot say how a change fares on another sample (rerun the live
benchmark for that).

Run from the repo root:
    .venv/bin/python -m benchmarks.advisor_replay --work-dir DIR [--work-dir DIR2 ...]
Writes benchmarks/results/advisor_replay.json (provenance and configuration included).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import add_common_args, config_of, setup, write_json

SCRIPT = "advisor_replay.py"
FIGURES = ("itl_p99_ms", "itl_max_ms", "ttft_p99_ms")
SHAPES = ("decode", "prefill", "vision prefill")
BATCHES = (("decode 1", 1, 1), ("decode 2-6", 2, 6), ("decode 7+", 7, 1 << 30))


def step_carry(db: Any, engine_id: str, report: Any, since: float, until: float) -> dict[str, Any]:
    """The steps of [since, until] against ``report``'s prediction, per step shape."""
    from advisor.fit import load_steps, step_work_list

    steps = load_steps(db, engine_id=engine_id, since=since, until=until)
    busy = steps[(steps["num_scheduled_tokens"] > 0) & (steps["end_ns"] >= steps["start_ns"])]
    if busy.empty:
        return {"num_steps": 0}
    pred = report.model.predict_many(step_work_list(busy))
    meas = (busy["end_ns"] - busy["start_ns"]).to_numpy(dtype=np.float64) / 1e9
    ok = pred > 0
    ratio, rel = meas[ok] / pred[ok], np.abs(pred[ok] - meas[ok]) / np.maximum(meas[ok], 1e-9)
    prefill = busy["prefill_tokens"].to_numpy()[ok]
    image = busy["image_prefill_tokens"].to_numpy()[ok]
    shape = np.where(prefill == 0, "decode", np.where(image > 0, "vision prefill", "prefill"))
    out: dict[str, Any] = {
        "num_steps": int(ok.sum()),
        "rel_err_p50": float(np.median(rel)),
        "ratio_p50": float(np.median(ratio)),
    }
    decodes = busy["decode_tokens"].to_numpy()[ok]
    groups = {name: shape == name for name in SHAPES}
    # decode-only steps by batch size (issue 19a: a lone decode, and batches larger than the
    # fit window held, are where the decode terms carry worst)
    for name, lo, hi in BATCHES:
        groups[name] = (shape == "decode") & (decodes >= lo) & (decodes <= hi)
    for name, m in groups.items():
        if m.any():
            out[name] = {
                "num_steps": int(m.sum()),
                "ratio_p50": float(np.median(ratio[m])),
                "rel_err_p50": float(np.median(rel[m])),
            }
    return out


def calibration_spans(work: Path, workload: str) -> list[tuple[float, float]]:
    """The calibration span ``benchmarks.advisor`` kept for ``workload`` (none if it ran none)."""
    path = work / f"{workload}-calibration.json"
    if not path.exists():
        return []
    d = json.loads(path.read_text())
    return [(float(d["since"]), float(d["until"]))]


def replay_workload(
    work: Path,
    workload: str,
    *,
    baseline_budget: int,
    draws: int,
    seed: int,
    use_calibration: bool = True,
) -> dict[str, Any]:
    from advisor.fit import fit_from_store
    from advisor.predict import fit_carry
    from advisor.traffic import observed_traffic
    from benchmarks.advisor import rel_err, replay, within_draws
    from storage import db as dbm

    base = json.loads((work / f"{workload}-baseline.json").read_text())
    sweep = json.loads((work / f"{workload}-sweep.json").read_text())
    url = f"sqlite:///{work / f'{workload}.db'}"
    engine_id = f"bench-advisor-{workload}"
    since, until = base["run"]["wall_start"], base["run"]["wall_end"]
    db = dbm.connect(url, readonly=True)
    try:
        cal = calibration_spans(work, workload) if use_calibration else []
        report = fit_from_store(db, engine_id=engine_id, since=since, until=until, calibration=cal)
        traffic = observed_traffic(db, engine_id=engine_id, since=since, until=until)
        quality = fit_carry(report, traffic, [w["budget"] for w in sweep["windows"]])
        carry = {baseline_budget: step_carry(db, engine_id, report, since, until)}
        for w in sweep["windows"]:
            carry[w["budget"]] = step_carry(db, engine_id, report, w["start"], w["end"])
    finally:
        db.dispose()
    rows = replay(
        url, engine_id, report.to_dict(), sweep, str(work / f"{workload}-baseline.json"),
        seed=seed, draws=draws,
    )  # fmt: skip
    windows = []
    for w, r in zip(sweep["windows"], rows, strict=True):
        row: dict[str, Any] = {"budget": w["budget"], "steps": carry[w["budget"]]}
        for k in FIGURES:
            row[f"measured_{k}"] = w[k]
            row[f"predicted_{k}"] = r.get(f"replay_{k}")
            row[f"error_{k}"] = rel_err(row[f"predicted_{k}"], w[k])
            lo_hi = r.get("replay_draw_range", {}).get(k)
            row[f"draw_range_{k}"] = lo_hi
            row[f"within_draws_{k}"] = within_draws(lo_hi, w[k])
        windows.append(row)
    held = [r for r in windows if r["budget"] != baseline_budget]
    med = {
        k: statistics.median(e)
        if (e := [r[f"error_{k}"] for r in held if r[f"error_{k}"] is not None])
        else None
        for k in FIGURES
    }
    return {
        "work_dir": str(work),
        "workload": workload,
        "calibration_used": bool(cal),
        "fit": {k: v for k, v in report.model.to_dict().items()},
        "fit_quality": quality,
        "recommends": not quality.get("poor"),
        "baseline_steps": carry[baseline_budget],
        "windows": windows,
        "median_error_other_budgets": med,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument(
        "--work-dir",
        action="append",
        required=True,
        help="a folder `benchmarks.advisor --work-dir` wrote (repeat for several runs)",
    )
    ap.add_argument("--workloads", default="chat_rag,vlm_mix,long_rag")
    ap.add_argument("--baseline-budget", type=int, default=1024)
    ap.add_argument("--draws", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-calibration",
        dest="use_calibration",
        action="store_false",
        help="fit on the baseline window alone, leaving out the calibration's steps",
    )
    a = ap.parse_args(argv)
    out_dir = setup(a)
    results = []
    for d in a.work_dir:
        work = Path(d)
        for workload in [w for w in a.workloads.split(",") if w]:
            if not (work / f"{workload}.db").exists():
                continue
            results.append(
                replay_workload(
                    work,
                    workload,
                    baseline_budget=a.baseline_budget,
                    draws=a.draws,
                    seed=a.seed,
                    use_calibration=a.use_calibration,
                )
            )
    if not results:
        ap.error("no WORKLOAD.db with its baseline and sweep JSON in the given folders")
    write_json(
        out_dir / "advisor_replay.json", {"runs": results}, script=SCRIPT, config=config_of(a)
    )
    for r in results:
        q = r["fit_quality"]
        spread = ", ".join(f"{b}: {100 * v:.0f}%" for b, v in q["carry"].items() if v is not None)
        print(
            f"{r['work_dir']} {r['workload']}: median error at other budgets "
            + ", ".join(
                f"{k} {'n/a' if v is None else f'{100 * v:.0f}%'}"
                for k, v in r["median_error_other_budgets"].items()
            )
            + f"; carry spread {spread}"
            + ("; POOR FIT: " + "; ".join(q["reasons"]) if q.get("poor") else "")
        )
        for w in r["windows"]:
            s = w["steps"]
            names = (*SHAPES, *(b[0] for b in BATCHES))
            shapes = ", ".join(f"{n} {s[n]['ratio_p50']:.2f}x" for n in names if n in s)
            print(
                f"  {w['budget']:>5}: steps |rel err| p50 {100 * s.get('rel_err_p50', 0):.0f}% "
                f"(measured/predicted: {shapes})  "
                + "  ".join(
                    f"{k} {w[f'measured_{k}']:.0f}/{w[f'predicted_{k}'] or 0:.0f} ms"
                    for k in FIGURES
                )
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
