"""`python -m loadgen` / `chunkscope loadgen`: plan traffic, run it, print and save the results."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from loadgen import __version__
from loadgen.arrivals import ARRIVALS
from loadgen.options import id_range, non_negative, non_negative_int, positive, setup
from loadgen.orchestrate import PlanError, run_from_args
from loadgen.profiles import MAX_CHAT_USERS
from loadgen.shapes import CHOICES as SHAPE_CHOICES
from loadgen.traces import FORMATS
from loadgen.workload import PROFILES

logger = logging.getLogger(__name__)

DEFAULT_NUM_REQUESTS = 100

_EPILOG = """\
profile parameters (defaults cited in loadgen/profiles.py) are overridden with
  --set CLASS.FIELD=VALUE   e.g. --set chat.input_median=500 --set vlm.camera_streams=8
  (tuples comma-separated: --set vlm.resolutions=640x480,1280x720 --set
  vlm.resolution_weights=1,1); --show-profiles prints every field and exits.
camera mode: --set vlm.camera_streams=N [--set vlm.camera_fps=2 --set vlm.camera_jitter_ms=20]
exit status: 0 run done, 1 no request succeeded, 2 usage error, 130 interrupted.
budget sweep (chunkscope): python -m loadgen sweep --url ... --budgets 128,512,2048 (see --help).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
        description="Chat / RAG / VLM / mixed traffic and trace replay against any "
        "OpenAI-compatible server, with client-side TTFT, ITL, TPOT and goodput.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--profile", choices=PROFILES, default="chat")
    p.add_argument("--rate", type=positive(float), help="total req/s (default: the profile's)")
    p.add_argument(
        "--shapes",
        choices=SHAPE_CHOICES,
        default="auto",
        help="named --set overrides applied before yours: demo (sized for chunkscope's CPU demo "
        "preset), realistic (the profiles' production defaults); auto: demo when the server's "
        "model is demo or tiny, else realistic",
    )
    p.add_argument(
        "--chat-background",
        type=non_negative,
        metavar="RATE",
        help="req/s of chat streams sent beside the profile's requests (default: "
        "chat.background_rate under rag and vlm, 0 under chat, mixed and traces; 0 = none)",
    )
    p.add_argument(
        "--chat-users",
        type=non_negative_int,
        metavar="N",
        help="closed-loop chat users beside the profile's requests: each sends its next turn "
        "chat.think_s after its answer ends, so about N chat streams are in flight (default: "
        "chat.background_users under rag, vlm and mixed, 0 under chat and traces; 0 = none)",
    )
    p.add_argument(
        "--arrival",
        choices=ARRIVALS,
        help="arrival process for every class (default: each class's own; chat and rag "
        "poisson, vlm gamma)",
    )
    p.add_argument(
        "--burstiness",
        type=positive(float),
        help="gamma shape: 1 = Poisson, < 1 burstier (CV = 1/sqrt(shape))",
    )
    p.add_argument(
        "--ramp",
        type=non_negative,
        default=0.0,
        metavar="SECONDS",
        help="rise linearly from --ramp-from to --rate over SECONDS, then hold",
    )
    p.add_argument(
        "--ramp-from",
        type=non_negative,
        default=0.0,
        metavar="RATE",
        help="req/s at the start of the ramp (default 0)",
    )
    p.add_argument(
        "--duration",
        type=positive(float),
        help="seconds of arrivals (with --num-requests: whichever ends first)",
    )
    p.add_argument(
        "--num-requests",
        type=positive(int),
        help=f"count of the profile's own requests (default {DEFAULT_NUM_REQUESTS} if no "
        "--duration); chat users send beside them until the last is sent",
    )
    p.add_argument("--max-concurrency", type=positive(int), help="cap on in-flight requests")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and images")
    p.add_argument(
        "--prompt-salt",
        type=int,
        help="token content salt (default random per run, so a rerun does not hit "
        "the server's prefix cache; fix it for identical prompts)",
    )
    p.add_argument("--trace", metavar="FILE", help="replay an Azure CSV or Mooncake JSONL trace")
    p.add_argument(
        "--trace-format",
        choices=FORMATS,
        default="auto",
        help="azure: TIMESTAMP,ContextTokens,GeneratedTokens CSV; mooncake: JSONL",
    )
    p.add_argument(
        "--time-scale",
        type=positive(float),
        default=1.0,
        help="trace time multiplier (0.5 = twice as fast)",
    )
    p.add_argument(
        "--trace-block-size",
        type=positive(int),
        default=512,
        help="tokens per Mooncake hash block",
    )
    p.add_argument("--slo-ttft-ms", type=positive(float), help="goodput SLO on TTFT")
    p.add_argument("--slo-itl-ms", type=positive(float), help="SLO on each request's TPOT")
    p.add_argument("--out", metavar="result.json", help="write the full result JSON here")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="CLASS.FIELD=VALUE",
        help="override a profile parameter",
    )
    p.add_argument("--show-profiles", action="store_true", help="print profile parameters, exit")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument(
        "--max-model-len",
        type=positive(int),
        help="context length for clipping (default: the server's, else 8192)",
    )
    p.add_argument(
        "--token-id-range",
        type=id_range,
        default=(32, 126),
        metavar="LO,HI",
        help="prompt token ids are drawn from [LO, HI] (default 32,126)",
    )
    p.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="auto: token ids unless the server answers 400 to them",
    )
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (outputs may end early)",
    )
    p.add_argument(
        "--request-timeout",
        type=positive(float),
        default=600.0,
        metavar="S",
        help="per-request limit (default 600)",
    )
    p.add_argument(
        "--drain-timeout",
        type=positive(float),
        default=600.0,
        metavar="S",
        help="after the last send, wait at most S for in-flight requests",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.add_argument("--version", action="version", version=f"loadgen {__version__}")
    return p


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["sweep"]:
        from loadgen.sweep import main as sweep_main

        return sweep_main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # auto: checked against the realistic set here; the run picks demo once it has seen the model
    profiles = setup(parser, args, "realistic" if args.shapes == "auto" else args.shapes)
    if args.show_profiles:
        print(json.dumps(profiles.as_dict(), indent=2))
        return 0
    if args.duration is None and args.num_requests is None and not args.trace:
        args.num_requests = DEFAULT_NUM_REQUESTS
    if args.chat_users is not None and args.chat_users > MAX_CHAT_USERS:
        parser.error(f"--chat-users must be at most {MAX_CHAT_USERS}, got {args.chat_users}")
    if args.ramp_from and not args.ramp:
        parser.error("--ramp-from needs --ramp SECONDS")
    if args.trace and not os.path.isfile(args.trace):
        parser.error(f"--trace: no such file: {args.trace}")
    if not args.url.startswith(("http://", "https://")):
        parser.error(f"--url must start with http:// or https://, got {args.url!r}")
    try:
        rc, summary_table = asyncio.run(run_from_args(args, profiles))
    except PlanError as exc:  # e.g. an unreadable trace, found once the context is known
        parser.error(str(exc))
    except KeyboardInterrupt:
        logger.warning("interrupted")
        return 130
    print(summary_table)
    return rc
