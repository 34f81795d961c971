"""`chunkscope blame`: who slowed a request, and which requests cost the others most, read
from a store (``advisor.blame``). Prints a short table, or JSON with ``--json``; exit status 2
with a one-line reason for a bad store, engine, request or window."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any

from advisor.blame import BlameError, model_dict
from advisor.blame_store import blame_request, blame_window, resolve_run

DEFAULT_WINDOW_S = 60.0


def build_parser(prog: str = "chunkscope blame") -> argparse.ArgumentParser:
    from storage.export import parse_time
    from wire import credentials

    p = argparse.ArgumentParser(
        prog=prog,
        description="The blame ledger: every gap before a request's tokens split into its own "
        "work, the engine's pauses and the excess, the excess attributed to the requests that "
        "ran in those steps by their cost in the fitted step-cost model. --request: what "
        "slowed one request; --top: the requests that cost the others most in a window.",
    )
    p.add_argument(
        "--db",
        default=credentials.from_env(credentials.DB_URL_ENV),
        help="the store's database URL, e.g. sqlite:///data/chunkscope.db (default: "
        f"${credentials.DB_URL_ENV}, else sqlite:///<data-dir>/chunkscope.db)",
    )
    p.add_argument(
        "--data-dir", default="./data", help="folder of the default SQLite store (default ./data)"
    )
    p.add_argument("--engine", required=True, metavar="ID", help="the engine id")
    p.add_argument("--run", default=None, metavar="ID", help="the run id (default: the newest)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--request",
        metavar="REQUEST_ID",
        help="the request's id as its client saw it (the completion's id, cmpl-... or "
        "chatcmpl-...)",
    )
    what.add_argument(
        "--top",
        type=int,
        metavar="N",
        help="the N requests that cost the others most in the window",
    )
    p.add_argument(
        "--since",
        type=parse_time,
        default=None,
        help=f"with --top: window start, seconds since the epoch or ISO-8601 (default: "
        f"{DEFAULT_WINDOW_S:.0f} s before --until)",
    )
    p.add_argument(
        "--until",
        type=parse_time,
        default=None,
        help="with --top: window end (default: the run's last step)",
    )
    p.add_argument(
        "--culprits", type=int, default=10, metavar="N", help="with --request: at most N culprits"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--log-level", default="ERROR", help="logging level (default ERROR)")
    return p


def _clean(value: Any) -> Any:
    """NaN and infinities as null (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def request_report(db: Any, args: argparse.Namespace) -> dict[str, Any]:
    out, blamed = blame_request(db, engine_id=args.engine, request_id=args.request, run_id=args.run)
    out["culprits"] = out["culprits"][: max(args.culprits, 0)]
    out["model"] = model_dict(blamed.fit.model, blamed.fit.quality)
    return out


def top_report(db: Any, args: argparse.Namespace) -> dict[str, Any]:
    if args.top < 1:
        raise BlameError(f"--top must be at least 1, got {args.top}")
    since, until = args.since, args.until
    if since is not None and until is not None and not until > since:
        raise BlameError(f"need --until after --since, got {since} and {until}")
    run = resolve_run(db, args.engine, args.run, since, until)
    if until is None and since is None:
        from storage import queries

        last = queries.steps(db, engine_id=args.engine, run_id=run, limit=1)
        until = float(last["end"].iloc[0])
    if since is None and until is not None:
        since = until - DEFAULT_WINDOW_S
    blamed = blame_window(db, engine_id=args.engine, run_id=run, since=since, until=until)
    ledger = blamed.ledger
    totals = ledger.totals()
    classes = ledger.by_class()
    return {
        "engine_id": args.engine,
        "run_id": run,
        "since": since,
        "until": until,
        "num_steps": len(ledger.steps),
        "num_requests": len(ledger.ids),
        "excess_ms": totals["excess_ms"],
        "by_class": classes.to_dict("records"),
        "offenders": ledger.offenders(args.top),
        "model": model_dict(blamed.fit.model, blamed.fit.quality),
    }


def _ms(v: Any) -> str:
    return "-" if v is None else f"{float(v):,.1f}"


def request_table(out: dict[str, Any]) -> str:
    lines = [
        f"request {out['request_id']} ({out.get('traffic_class') or 'no class'}, "
        f"{out.get('num_prompt_tokens') or '?'} prompt tokens), engine {out['engine_id']} "
        f"run {out['run_id']}",
        f"  arrival to last token {_ms(out['measured_ms'])} ms = own work "
        f"{_ms(out['own_ms'])} + pauses {_ms(out['pause_ms'])} + excess "
        f"{_ms(out['excess_ms'])} ms (queued {_ms(out['queue_ms'])} ms); "
        f"{out['num_stalls']} of {out['num_gaps']} gaps were stalls",
        "",
        f"  {'culprit':<40} {'class':<8} {'prompt':>7} {'ms':>10} {'queued':>9} {'gaps':>6}",
    ]
    for c in out["culprits"]:
        lines.append(
            f"  {c['request_id']:<40} {str(c.get('traffic_class') or '-'):<8} "
            f"{str(c.get('num_prompt_tokens') or '-'):>7} {_ms(c['ms']):>10} "
            f"{_ms(c['queue_ms']):>9} {c['gaps']:>6}"
        )
    if not out["culprits"]:
        lines.append("  (nobody: the request ran alone)")
    return "\n".join(lines)


def top_table(out: dict[str, Any]) -> str:
    lines = [
        f"engine {out['engine_id']} run {out['run_id']}: {out['num_steps']} steps, "
        f"{out['num_requests']} requests, {_ms(out['excess_ms'])} ms of excess in all",
        "  by class: "
        + (
            ", ".join(f"{c['traffic_class']} {100 * c['share']:.0f}%" for c in out["by_class"])
            or "none"
        ),  # fmt: skip
        "",
        f"  {'offender':<40} {'class':<8} {'prompt':>7} {'cost ms':>10} {'victims':>8} "
        f"{'worst ms':>9}",
    ]
    for o in out["offenders"]:
        lines.append(
            f"  {o['request_id']:<40} {str(o.get('traffic_class') or '-'):<8} "
            f"{str(o.get('num_prompt_tokens') or '-'):>7} {_ms(o['cost_to_others_ms']):>10} "
            f"{o['victims']:>8} {_ms(o['worst_victim_ms']):>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "chunkscope blame") -> int:
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from sqlalchemy.exc import SQLAlchemyError

    from storage.db import default_url
    from storage.export_read import ExportError, open_store

    try:
        db = open_store(args.db or default_url(args.data_dir))
    except ExportError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        out = request_report(db, args) if args.request is not None else top_report(db, args)
    except BlameError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: cannot read the store: {first}", file=sys.stderr)
        return 2
    finally:
        db.dispose()
    if args.json:
        print(json.dumps(_clean(out), allow_nan=False))
    else:
        print(request_table(out) if args.request is not None else top_table(out))
    return 0


__all__ = ["build_parser", "main"]
