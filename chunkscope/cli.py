"""The `chunkscope` console script: one command, one subcommand per job.

Each subcommand imports what it runs only when it runs, so that `chunkscope loadgen`,
`chunkscope collector` and `chunkscope export` never import torch. The `python -m ...` forms
listed in `chunkscope --help` run the same code.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROG = "chunkscope"
DASHBOARD_PORT = 8501


@dataclass(frozen=True)
class Subcommand:
    name: str
    summary: str
    # the same job by another command ("" for none)
    alias: str
    run: Callable[[list[str]], int]
    # words after the name that open a help of their own, e.g. `chunkscope control engines`
    nested: tuple[str, ...] = ()


def _engine(argv: list[str]) -> int:
    from engine.server.cli import main

    return main(argv, prog=f"{PROG} engine")


def _collector(argv: list[str]) -> int:
    from storage.cli import run_collector

    return run_collector(argv, prog=f"{PROG} collector")


def _dashboard(argv: list[str]) -> int:
    cmd = dashboard_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


def _loadgen(argv: list[str]) -> int:
    from loadgen.cli import main

    return main(argv)


def _sweep(argv: list[str]) -> int:
    from loadgen.sweep import main

    return main(argv)


def _advise(argv: list[str]) -> int:
    from advisor.cli import advise_main

    return advise_main(argv, prog=f"{PROG} advise")


def _autopilot(argv: list[str]) -> int:
    from advisor.autopilot_run import main

    return main(argv)


def _control(argv: list[str]) -> int:
    from storage.cli import run_control, run_engines

    engines = f"{PROG} control engines"
    if argv[:1] == ["engines"]:
        return run_engines(argv[1:], prog=engines)
    return run_control(argv, prog=f"{PROG} control", engines_prog=engines)


def _export(argv: list[str]) -> int:
    from advisor.blame_trace import trace_links
    from storage.export import main

    # the Chrome trace with the blame ledger's arrows from each culprit to each stall
    return main(argv, prog=f"{PROG} export", links=trace_links)


def _blame(argv: list[str]) -> int:
    from advisor.blame_cli import main

    return main(argv, prog=f"{PROG} blame")


def _prune(argv: list[str]) -> int:
    from storage.cli import run_prune

    return run_prune(argv, prog=f"{PROG} prune")


def _vllm(argv: list[str]) -> int:
    from chunkscope.integrations.vllm_launch import main

    return main(argv)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "engine",
        "serve the chunked-prefill engine behind an OpenAI-compatible HTTP API",
        "python -m engine",
        _engine,
    ),
    Subcommand(
        "collector",
        "store engines' telemetry in SQLite or PostgreSQL and relay controls to them",
        "python -m storage",
        _collector,
    ),
    Subcommand(
        "dashboard",
        "watch and steer engines in the browser (Streamlit, on 127.0.0.1); without a collector "
        "it starts its own collector and demo engine",
        "streamlit run dashboard",
        _dashboard,
    ),
    Subcommand(
        "loadgen",
        "replay chat / RAG / VLM / mixed traffic against an OpenAI-compatible server",
        "python -m loadgen",
        _loadgen,
    ),
    Subcommand(
        "sweep",
        "one window of traffic per token budget on a chunkscope engine, and the budget to use",
        "python -m loadgen sweep",
        _sweep,
    ),
    Subcommand(
        "advise",
        "predict each token budget's latency and throughput from the stored traffic, and "
        "recommend one",
        "python -m advisor predict",
        _advise,
        nested=("calibrate",),
    ),
    Subcommand(
        "autopilot",
        "set an engine's token budget and long-prefill cap live to SLOs, through a collector",
        "python -m advisor.autopilot_run",
        _autopilot,
    ),
    Subcommand(
        "control",
        "set an engine's token budget, policy or long-prefill cap through a collector, or "
        "list the engines",
        "python -m storage control / engines",
        _control,
        nested=("engines",),
    ),
    Subcommand(
        "export",
        "write stored telemetry as a Chrome trace (Perfetto) or CSV / Parquet tables",
        "python -m storage export",
        _export,
    ),
    Subcommand(
        "blame",
        "who slowed a request, and which requests cost the others most: stalls attributed by "
        "the fitted step-cost model",
        "",
        _blame,
    ),
    Subcommand(
        "prune",
        "delete old telemetry from a store, by age and/or size",
        "python -m storage prune",
        _prune,
    ),
    Subcommand(
        "vllm",
        "start vLLM's OpenAI server with chunkscope's scheduler bridge reporting to a collector",
        "",
        _vllm,
    ),
)
BY_NAME = {s.name: s for s in SUBCOMMANDS}


def usage() -> str:
    """`chunkscope --help`."""
    width = 100
    lines = [
        f"usage: {PROG} [-h] [--version] SUBCOMMAND [options]",
        "",
        "chunkscope: a chunked-prefill LLM serving engine you can watch and steer while it runs.",
        "One command for every job; each subcommand has its own --help.",
        "",
        "subcommands:",
    ]
    indent = " " * 13
    for sub in SUBCOMMANDS:
        # the alias is not broken across lines (no-break spaces, made plain after wrapping)
        alias = " (" + sub.alias.replace(" ", "\xa0") + ")" if sub.alias else ""
        wrapped = textwrap.wrap(
            sub.summary + alias,
            width,
            initial_indent=f"  {sub.name:<10} ",
            subsequent_indent=indent,
        )
        lines += [line.replace("\xa0", " ") for line in wrapped]
    lines += [
        "",
        "options:",
        "  -h, --help   show this help message and exit",
        "  --version    show the version and exit",
        "",
        f"Run `{PROG} SUBCOMMAND --help` for the options of each.",
    ]
    return "\n".join(lines) + "\n"


def version() -> str:
    from chunkscope import __version__

    return __version__


# ---- chunkscope dashboard ----------------------------------------------------------------------

# scripts/run.sh's flags: loopback only (the dashboard has no login), no browser opened, no usage
# statistics, no developer menu
_STREAMLIT_FLAGS = (
    "--server.headless",
    "true",
    "--browser.gatherUsageStats",
    "false",
    "--client.toolbarMode",
    "viewer",
)


_DASHBOARD_APP_PROG = f"{PROG} dashboard --"


def dashboard_parser() -> argparse.ArgumentParser:
    from dashboard.settings import build_parser

    app = build_parser()
    app.prog = _DASHBOARD_APP_PROG
    p = argparse.ArgumentParser(
        prog=f"{PROG} dashboard",
        usage=f"{PROG} dashboard [-h] [--port PORT] [-- DASHBOARD OPTIONS]",
        description=textwrap.fill(
            "Run the dashboard (streamlit run dashboard) on http://127.0.0.1:PORT, headless, "
            "without usage statistics. Options after -- go to the dashboard; they are listed "
            "below.",
            78,
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="dashboard options (after --):\n\n" + app.format_help(),
    )
    p.add_argument(
        "--port",
        type=int,
        default=DASHBOARD_PORT,
        help=f"the port to serve on (default {DASHBOARD_PORT}); the address is 127.0.0.1",
    )
    return p


def dashboard_command(argv: list[str]) -> list[str]:
    """The streamlit command line of `chunkscope dashboard ARGV`; the options after `--` are
    checked here first (a usage error exits 2, `-- --help` prints them and exits 0)."""
    import importlib.util

    from dashboard.settings import build_parser

    ours, app = argv, []
    if "--" in argv:
        cut = argv.index("--")
        ours, app = argv[:cut], argv[cut + 1 :]
    args = dashboard_parser().parse_args(ours)
    checker = build_parser()
    checker.prog = _DASHBOARD_APP_PROG
    checker.parse_args(app)
    spec = importlib.util.find_spec("dashboard")
    assert spec is not None and spec.origin is not None
    folder = str(Path(spec.origin).parent)
    cmd = [sys.executable, "-m", "streamlit", "run", folder, "--server.address", "127.0.0.1"]
    cmd += ["--server.port", str(args.port), *_STREAMLIT_FLAGS]
    return cmd + (["--", *app] if app else [])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), end="")
        return 2
    if args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    if args[0] == "--version":
        print(f"{PROG} {version()}")
        return 0
    sub = BY_NAME.get(args[0])
    if sub is None:
        print(f"{PROG}: unknown subcommand {args[0]!r}\n\n{usage()}", end="", file=sys.stderr)
        return 2
    return sub.run(args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
