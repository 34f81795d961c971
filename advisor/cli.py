"""`python -m advisor predict`: predicted latency and throughput per budget, from the store."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from advisor.recommend import Slo
from advisor.text import (
    DEFAULT_BUDGETS,
    DEFAULT_CAPS,
    WINDOW_COLUMNS,
    budget_table,
    parse_budgets,
    parse_caps,
)

logger = logging.getLogger(__name__)


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


DESCRIPTION = (
    "Budget advisor: predict what each token budget would do to TTFT, ITL and throughput for "
    "the traffic recorded in the store, and recommend one."
)
PREDICT_HELP = "fit the step cost model, simulate the observed traffic at each budget, recommend"
CALIBRATE_HELP = (
    "prefill prompts of a few lengths one at a time at each budget on a served engine (its "
    "telemetry stores the steps), so that `predict --calibration` pins the cost of every chunk "
    "size down"
)


def build_parser(prog: str = "advisor") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)
    add_predict_arguments(sub.add_parser("predict", help=PREDICT_HELP))
    add_calibrate_arguments(sub.add_parser("calibrate", help=CALIBRATE_HELP))
    return p


def build_advise_parser(prog: str = "chunkscope advise") -> argparse.ArgumentParser:
    """`chunkscope advise`: `predict`'s options on a parser of its own."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=f"{DESCRIPTION} The same as `python -m advisor predict`.",
        epilog=f"`{prog} calibrate --help`: measure the cost of each chunk size on a served "
        "engine first (python -m advisor calibrate).",
    )
    add_predict_arguments(p)
    return p


def build_calibrate_parser(prog: str = "chunkscope advise calibrate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=CALIBRATE_HELP[0].upper() + CALIBRATE_HELP[1:]
    )
    add_calibrate_arguments(p)
    return p


def add_predict_arguments(pr: argparse.ArgumentParser) -> None:
    pr.add_argument("--db", required=True, help="store URL, e.g. sqlite:///data/chunkscope.db")
    pr.add_argument("--engine", dest="engine_id", help="engine id (default: all)")
    pr.add_argument("--run", dest="run_id", help="run id (default: all)")
    pr.add_argument("--since", type=float, help="window start, wall seconds since the epoch")
    pr.add_argument("--until", type=float, help="window end, wall seconds since the epoch")
    pr.add_argument("--fit-since", type=float, help="steps to fit from (default: --since)")
    pr.add_argument("--fit-until", type=float, help="steps to fit until (default: --until)")
    pr.add_argument("--budgets", type=parse_budgets, default=parse_budgets(DEFAULT_BUDGETS))
    pr.add_argument(
        "--caps",
        type=parse_caps,
        default=parse_caps(DEFAULT_CAPS),
        help="long-prefill caps (long_prefill_token_threshold, 0 = off) to try beside each "
        "budget, e.g. 0,256; the recommendation is then a (budget, cap) pair",
    )
    pr.add_argument("--slo-itl-ms", type=_positive, help="SLO on the p99 inter-token latency")
    pr.add_argument("--slo-ttft-ms", type=_positive, help="SLO on the p99 time to first token")
    pr.add_argument(
        "--slo-itl-max-ms",
        type=_positive,
        help="SLO on the longest inter-token gap (a stall that a p99 SLO cannot see)",
    )
    pr.add_argument(
        "--slo-itl-p999-ms", type=_positive, help="SLO on the p99.9 inter-token latency"
    )
    pr.add_argument(
        "--no-step-gap",
        dest="step_gap",
        action="store_false",
        help="do not add the measured pause between steps to each simulated step",
    )
    pr.add_argument(
        "--no-noise",
        dest="noise",
        action="store_false",
        help="bare predicted step times (no measured scatter; the median pause between steps)",
    )
    pr.add_argument("--seed", type=int, default=0, help="seeds the drawn scatter")
    pr.add_argument(
        "--fit-method",
        choices=("sqrt", "ols", "relative"),
        default="sqrt",
        help="least squares with each step weighted by 1/sqrt(its duration) (the default: short "
        "and long steps both count), ordinary least squares (engine.core.cost_model.fit: long "
        "steps dominate) or least squares on relative errors (short steps count as much as "
        "long ones)",
    )
    pr.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="measure from --since plus this many seconds (like a sweep window's warm-up)",
    )
    pr.add_argument(
        "--client-run",
        metavar="FILE.json",
        help="a `python -m loadgen --out` result against this engine: add the client's "
        "delivery (its TTFT and gap differences from the engine's) to the predicted figures",
    )
    pr.add_argument(
        "--draws",
        type=int,
        default=1,
        help="simulate each budget N times (other draws of the measured scatter) and give each "
        "figure's median: steadier p99 and max (N times the simulation time)",
    )
    pr.add_argument(
        "--allow-poor-fit",
        action="store_true",
        help="recommend even when the step-cost model fits poorly (its constant above the "
        "cheapest steps, a step shape it misses, the machine changing speed, too few prefill "
        "steps); by default such a fit gives its figures, flagged, and no recommendation",
    )
    pr.add_argument(
        "--calibration",
        metavar="FILE.json",
        action="append",
        default=[],
        help="a `python -m advisor calibrate --out` record on this engine: its steps (long "
        "prefill chunks of every budget's size) are fitted with the window's (repeatable)",
    )
    pr.add_argument("--out", metavar="FILE.json", help="write the prediction document here")
    pr.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def add_calibrate_arguments(ca: argparse.ArgumentParser) -> None:
    ca.add_argument("--url", required=True, help="the engine's HTTP address")
    ca.add_argument("--budgets", type=parse_budgets, default=parse_budgets(DEFAULT_BUDGETS))
    ca.add_argument(
        "--prompt-tokens",
        type=parse_budgets,
        default=None,
        help="prompt lengths run at every budget (default 600,1900,3900)",
    )
    ca.add_argument("--repeats", type=int, default=2)
    ca.add_argument(
        "--decode-batches",
        type=parse_budgets,
        default=None,
        help="then this many short requests at once, each size in turn (default 4,8,16): "
        "decode steps of every batch size",
    )
    ca.add_argument("--max-model-len", type=int, help="cut prompts to this context less two")
    ca.add_argument(
        "--control-token",
        default=os.environ.get("CHUNKSCOPE_CONTROL_TOKEN"),
        help="the engine's control token (default $CHUNKSCOPE_CONTROL_TOKEN)",
    )
    ca.add_argument("--out", metavar="FILE.json", required=True, help="the calibration record")
    ca.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def table(doc: dict[str, Any]) -> str:
    fit = doc["fit"]
    m = fit["model"]
    lines = [
        f"cost model ({fit['num_steps']} steps, {fit.get('num_outliers', 0)} outliers left out): "
        f"step = {m['const'] * 1e3:.3g} ms "
        f"+ {m['prefill'] * 1e6:.3g} us/prefill token + {m['decode'] * 1e6:.3g} us/decode token "
        f"+ {m['attn'] * 1e9:.3g} ns/attention pair "
        f"(+ {m.get('attn_decode', 0.0) * 1e9:.3g} ns/decode pair); relative error p50 "
        f"{100 * m['rel_err_p50']:.1f}% p95 {100 * m['rel_err_p95']:.1f}%, R^2 {m['r2']:.3f} "
        f"(all steps: p50 {100 * fit.get('rel_err_p50_all', 0):.1f}% "
        f"p95 {100 * fit.get('rel_err_p95_all', 0):.1f}%); "
        f"pause between steps {fit['step_gap_s'] * 1e3:.2f} ms",
        f"traffic: {doc['traffic']['classes'].get('all', {}).get('num_requests', 0)} requests "
        f"over {doc['traffic']['duration_s']:.0f} s",
    ]
    quality = doc.get("fit_quality") or {}
    carry = {b: v for b, v in (quality.get("carry") or {}).items() if v is not None}
    if carry:
        lines.append(
            "prefill cost on resampled steps: p10-p90 spread "
            + ", ".join(f"{100 * v:.0f}% at {b}" for b, v in carry.items())
        )
    if quality.get("poor"):
        lines.append("poor fit: " + "; ".join(quality.get("reasons") or ()))
    lines += budget_table(doc["windows"], WINDOW_COLUMNS, doc["pareto_budgets"])
    seen = doc.get("observed_window") or {}
    if seen.get("overloaded"):
        lines.append(f"observed window overloaded: {seen.get('overload_reason')}")
    lines.append(doc["reason"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def advise_main(argv: list[str], prog: str = "chunkscope advise") -> int:
    """`chunkscope advise [predict] ...` (python -m advisor predict) and `chunkscope advise
    calibrate ...` (python -m advisor calibrate)."""
    if argv[:1] == ["calibrate"]:
        args = build_calibrate_parser(f"{prog} calibrate").parse_args(argv[1:])
        args.command = "calibrate"
    else:
        args = build_advise_parser(prog).parse_args(argv[1:] if argv[:1] == ["predict"] else argv)
        args.command = "predict"
    return run(args)


def run(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=args.log_level,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    if args.command == "calibrate":
        return _calibrate(args)
    from advisor.fit import FitError
    from advisor.predict import predict_from_store

    try:
        spans = [_span(path) for path in args.calibration]
        doc = predict_from_store(
            args.db,
            args.budgets,
            engine_id=args.engine_id,
            run_id=args.run_id,
            since=args.since,
            until=args.until,
            fit_since=args.fit_since,
            fit_until=args.fit_until,
            slo=Slo(args.slo_itl_ms, args.slo_ttft_ms, args.slo_itl_max_ms, args.slo_itl_p999_ms),
            step_gap=args.step_gap,
            noise=args.noise,
            seed=args.seed,
            warmup_s=args.warmup_s,
            client=args.client_run,
            fit_method=args.fit_method,
            caps=args.caps,
            allow_poor_fit=args.allow_poor_fit,
            draws=args.draws,
            calibration=spans,
        )
    except (FitError, ValueError, OSError, KeyError) as exc:
        print(f"advisor: {exc}", file=sys.stderr)
        return 1
    doc["config"] = {k: v for k, v in vars(args).items() if k != "db"}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(table(doc))
    return 0


def _span(path: str) -> tuple[float, float]:
    """The (since, until) of a calibration record."""
    d = json.loads(Path(path).read_text())
    return float(d["since"]), float(d["until"])


def _calibrate(args: argparse.Namespace) -> int:
    from advisor.calibrate import DECODE_BATCHES, PROMPT_TOKENS, CalibrationError, calibrate

    try:
        cal = calibrate(
            args.url,
            args.budgets,
            prompt_tokens=args.prompt_tokens or PROMPT_TOKENS,
            repeats=args.repeats,
            control_token=args.control_token,
            max_model_len=args.max_model_len,
            decode_batches=args.decode_batches or DECODE_BATCHES,
        )
    except (CalibrationError, OSError, KeyError, ValueError) as exc:
        print(f"advisor: calibration failed: {exc}", file=sys.stderr)
        return 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
    print(
        f"calibration: {cal.requests} prompts at budgets {cal.budgets} in "
        f"{cal.until - cal.since:.1f} s (wall {cal.since:.3f} to {cal.until:.3f}); "
        f"use it with `advisor predict --calibration {args.out}`"
    )
    return 0
