"""How heavy should ``benchmarks/autopilot.py``'s traffic be on this engine? Chosen by a rule,
from a fit and the simulator, before any autopilot arm runs at it.

The autopilot benchmark's rates (chat 0.5, RAG 0.2, images 0.3 req/s) were chosen for an engine
whose steps were about three times as long as they are after issue 20; on the faster engine every
static setting meets nearly every request and no setting can win much over another. This script
picks ``--load-scale`` (a factor on all three rates; phases, lengths, SLOs and arms unchanged) by
a rule fixed before it runs, the serving literature's capacity point (DistServe, OSDI '24,
defines goodput as the highest rate at which 90% of requests attain their SLOs):

    the largest scale on the grid at which, on every seed, the best static arm of that seed is
    predicted to meet the SLOs for at least ``--attainment`` (90%) of the requests of every phase.

The autopilot plays no part in the rule (nor does the 2048 reference arm in particular); what the
static arms do at each scale is written beside it, so a reader can see what the choice implies.

Inputs: a store of this engine serving the benchmark's own replay at two static budgets (a seed
that is not an evaluation seed), kept with ``--keep-store``:

    flock /work/notes/bench.lock .venv/bin/python -m benchmarks.autopilot \\
        --arms 256/0,16384/0 --seeds 100 --keep-store /tmp/autopilot-cal.db --out-dir /tmp/cal
    .venv/bin/python -m benchmarks.autopilot_load --store /tmp/autopilot-cal.db

The step-cost model is fitted on that store (``advisor.fit.fit_from_store``); each seed's replay
at each scale is simulated at every static arm with the engine's scheduler
(``advisor.simulate``), step times drawn from the fit with its scatter, ``--draws`` draws, the
median count per phase. An image request's text tokens are the store's median (its prompt less
its image tokens). Writes ``autopilot_load.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from advisor.autopilot import AutopilotSlo, Setting, request_meets, simulate_settings
from advisor.fit import FitReport, fit_from_store
from advisor.simulate import EngineShape
from advisor.traffic import ObservedRequest, Traffic, engine_shape
from benchmarks._common import config_of, setup, write_json
from benchmarks.autopilot import (
    ENGINE_ID,
    Arm,
    _class_slos,
    build_replay,
    phase_bounds,
    static_arms,
)
from benchmarks.autopilot import build_parser as bench_parser
from loadgen.spec import RequestSpec

SCRIPT = "autopilot_load.py"


def vlm_text_tokens(db: Any) -> tuple[int, int]:
    """(image tokens per image, text tokens per image request) as the store measured them."""
    from storage import queries

    df = queries.requests(db, engine_id=ENGINE_ID)
    img = df[df["num_image_tokens"].fillna(0) > 0]
    if img.empty:
        raise SystemExit("the store holds no image request: serve the replay's image phase first")
    per_image = int(img["num_image_tokens"].median())
    text = int((img["num_prompt_tokens"] - img["num_image_tokens"]).median())
    return per_image, max(0, text)


def to_traffic(specs: list[RequestSpec], per_image: int, text: int, span: float) -> Traffic:
    reqs = []
    for s in specs:
        image = per_image * len(s.images)
        prompt = s.prompt_len if not s.is_chat else image + text
        reqs.append(
            ObservedRequest(
                str(s.index), s.traffic_class, s.offset_s, prompt, image, 0, s.max_tokens
            )
        )
    reqs.sort(key=lambda r: r.arrival)
    return Traffic(reqs, 0.0, span)


def simulate_arm(
    fit: FitReport,
    traffic: Traffic,
    shape: EngineShape,
    arm: Arm,
    slo: AutopilotSlo,
    bounds: list[tuple[str, float, float]],
    draw: int,
) -> dict[str, tuple[int, int]]:
    """Per phase (requests meeting the SLOs, requests), one draw of the step-time scatter."""
    [res] = simulate_settings(
        fit, traffic, shape, [Setting(arm.budget, arm.cap)], seed=draw, max_steps=400_000
    )
    out = {name: [0, 0] for name, _, _ in bounds}
    for o in res.requests:
        t = o.token_times_ns
        ttft = (t[0] - o.arrival_ns) / 1e9 if t else None
        gaps = list(np.diff(np.asarray(t, dtype=np.int64)) / 1e9) if len(t) > 1 else []
        at = o.arrival_ns / 1e9
        for name, lo, hi in bounds:
            if lo <= at < hi:
                out[name][0] += request_meets(ttft, gaps, slo, o.traffic_class)
                out[name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def choose(rows: list[dict[str, Any]], attainment: float) -> float | None:
    """The largest scale whose every seed's best static arm meets ``attainment`` of every
    phase (the rule in the module docstring); None when no scale does."""
    ok = [r["scale"] for r in rows if all(s["best_serves"] for s in r["seeds"])]
    return max(ok) if ok else None


def build_parser() -> argparse.ArgumentParser:
    ap = bench_parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--store", required=True, help="SQLite store of the calibration run")
    ap.add_argument("--scales", default="1,1.5,2,2.5,3,4,5")
    ap.add_argument("--draws", type=int, default=3)
    ap.add_argument("--attainment", type=float, default=0.9)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = setup(args)
    from storage import db as dbm

    if not Path(args.store).is_file():
        raise SystemExit(f"no store at {args.store}")
    db = dbm.connect(f"sqlite:///{args.store}", readonly=True)
    fit = fit_from_store(db, engine_id=ENGINE_ID, resamples=0)
    shape = engine_shape(db, engine_id=ENGINE_ID)
    per_image, text = vlm_text_tokens(db) if args.image_rate > 0 else (0, 0)
    slo = AutopilotSlo(args.slo_itl_ms, args.slo_ttft_ms, None, _class_slos(args))
    budgets = [int(x) for x in args.budgets.split(",")]
    caps = [int(x) for x in args.caps.split(",") if x]
    arms = static_arms(budgets, caps, args.reference_budget)
    bounds = phase_bounds(args)
    span = bounds[-1][2]
    rows = []
    for scale in (float(x) for x in args.scales.split(",")):
        args.load_scale = scale
        seeds = []
        for seed in (int(x) for x in args.seeds.split(",")):
            specs, _ = build_replay(args, seed)
            traffic = to_traffic(specs, per_image, text, span)
            per_arm = {}
            for arm in arms:
                draws = [
                    simulate_arm(fit, traffic, shape, arm, slo, bounds, d)
                    for d in range(args.draws)
                ]
                per_arm[arm.name] = {
                    name: (
                        int(statistics.median(d[name][0] for d in draws)),
                        draws[0][name][1],
                    )
                    for name, _, _ in bounds
                }
            totals = {a: sum(m for m, _ in ph.values()) for a, ph in per_arm.items()}
            best = max(totals, key=lambda a: totals[a])
            serves = all(m >= args.attainment * n for m, n in per_arm[best].values() if n)
            ref = f"{args.reference_budget}/0"
            seeds.append(
                {
                    "seed": seed,
                    "num_requests": len(specs),
                    "met": totals,
                    "per_phase": {
                        a: {k: list(v) for k, v in ph.items()} for a, ph in per_arm.items()
                    },
                    "best_static": best,
                    "best_serves": serves,
                    "best_vs_reference": totals[best] / max(totals[ref], 1),
                }
            )
            print(
                f"scale {scale:g} seed {seed}: {len(specs)} requests, met "
                + ", ".join(f"{a} {m}" for a, m in totals.items())
                + f"; best {best} {'serves' if serves else 'does not serve'} every phase at "
                f"{args.attainment:.0%}",
                flush=True,
            )
        rows.append({"scale": scale, "seeds": seeds})
    chosen = choose(rows, args.attainment)
    print(f"chosen --load-scale: {chosen}")
    write_json(
        out_dir / "autopilot_load.json",
        {
            "rule": (
                "the largest scale at which, on every seed, the best static arm is predicted to "
                f"meet the SLOs for at least {args.attainment:.0%} of every phase's requests"
            ),
            "chosen_scale": chosen,
            "fit": {
                "num_steps": fit.num_steps,
                "rel_err_p50": fit.model.rel_err_p50,
                "r2": fit.model.r2,
            },
            "image_tokens_per_image": per_image,
            "vlm_text_tokens": text,
            "scales": rows,
        },
        script=SCRIPT,
        config=config_of(args),
    )
    db.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
