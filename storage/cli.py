"""``python -m storage``: the telemetry collector, and two small control clients.

python -m storage [collector] [--host H] [--port P] [--db URL | --data-dir DIR] ...
python -m storage control --url ws://127.0.0.1:8765 --engine ID --token-budget 512
python -m storage engines --url ws://127.0.0.1:8765
python -m storage export --db URL --format chrome-trace|csv|parquet --out PATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from storage.db import default_url
from wire.ready import collector_ready_line

logger = logging.getLogger(__name__)

DEFAULT_URL = "ws://127.0.0.1:8765"


def _collector_parser() -> argparse.ArgumentParser:
    from storage.collector import DEFAULT_MAX_FRAME_BYTES, DEFAULT_PORT

    p = argparse.ArgumentParser(
        prog="python -m storage",
        description="Telemetry collector: engines stream step, request and control events to "
        "ws://HOST:PORT/ingest; they are stored in SQLite (WAL) or PostgreSQL. Control clients "
        "use ws://HOST:PORT/control; GET /healthz and /metrics answer on the same port. "
        "Other subcommands: `control`, `engines`, `export` (see `python -m storage control "
        "--help`).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port to bind (default {DEFAULT_PORT}; 0 picks a free one, printed on start)",
    )
    p.add_argument(
        "--db",
        default=None,
        help="SQLAlchemy database URL, e.g. sqlite:///data/chunkscope.db or "
        "postgresql+psycopg://user:pw@host/db (default: sqlite:///<data-dir>/chunkscope.db)",
    )
    p.add_argument(
        "--data-dir", default="./data", help="folder of the default SQLite store (default ./data)"
    )
    p.add_argument(
        "--auth-token",
        default=os.environ.get("CHUNKSCOPE_AUTH_TOKEN"),
        help="when set, engines must send it in their hello and control clients as ?token= "
        "or an Authorization: Bearer header (default: $CHUNKSCOPE_AUTH_TOKEN, else none)",
    )
    p.add_argument(
        "--control-token",
        default=os.environ.get("CHUNKSCOPE_CONTROL_TOKEN"),
        help='when set, every control message must carry it as "token" '
        "(default: $CHUNKSCOPE_CONTROL_TOKEN, else none)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=int,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="largest frame accepted in bytes; bigger ones close the connection with 1009 "
        f"(default {DEFAULT_MAX_FRAME_BYTES})",
    )
    p.add_argument(
        "--control-timeout",
        type=float,
        default=15.0,
        help="seconds to wait for an engine's answer to a relayed control (default 15)",
    )
    p.add_argument(
        "--db-connect-timeout",
        type=float,
        default=None,
        help="PostgreSQL: seconds to wait for a connection (default "
        "$CHUNKSCOPE_DB_CONNECT_TIMEOUT, else 10)",
    )
    p.add_argument(
        "--db-statement-timeout",
        type=float,
        default=None,
        help="PostgreSQL: longest statement in seconds, 0 for none (default "
        "$CHUNKSCOPE_DB_STATEMENT_TIMEOUT, else 60)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def run_collector(argv: list[str]) -> int:
    from storage.collector import Collector, CollectorConfig

    args = _collector_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # one line per connection and HTTP probe is noise at INFO
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    try:
        config = CollectorConfig(
            db_url=args.db or default_url(args.data_dir),
            host=args.host,
            port=args.port,
            auth_token=args.auth_token,
            control_token=args.control_token,
            max_frame_bytes=args.max_frame_bytes,
            control_timeout=args.control_timeout,
            db_connect_timeout=args.db_connect_timeout,
            db_statement_timeout=args.db_statement_timeout,
        )
    except ValueError as exc:
        print(f"python -m storage: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        collector = Collector(config)
        await collector.start()
        print(collector_ready_line(collector.url), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("stopping: writing what is queued")
        await collector.stop()

    try:
        asyncio.run(main())
    except ValueError as exc:
        print(f"python -m storage: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, the data folder cannot be written, ...
        print(f"python -m storage: cannot listen or open the store: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from sqlalchemy.exc import SQLAlchemyError

        if not isinstance(exc, SQLAlchemyError):
            raise
        print(f"python -m storage: cannot open the store {config.db_url!r}: {exc}", file=sys.stderr)
        return 1
    return 0


def run_control(argv: list[str]) -> int:
    from storage.control import send_control

    p = argparse.ArgumentParser(
        prog="python -m storage control",
        description="Change an engine's token budget, policy or long-prefill cap through the "
        "collector; prints "
        "the engine's answer (JSON). Exit status 0 when applied, 1 when refused.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"collector URL (default {DEFAULT_URL})")
    p.add_argument("--engine", required=True, help="engine id (see `python -m storage engines`)")
    p.add_argument("--token-budget", type=int, default=None, help="new token budget per step")
    p.add_argument("--policy", default=None, help="new scheduling policy (chunked, unchunked)")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="new cap on one request's prefill tokens per step while other prompts wait (0: off)",
    )
    p.add_argument("--token", default=None, help="control token, when one is configured")
    p.add_argument(
        "--auth-token",
        default=os.environ.get("CHUNKSCOPE_AUTH_TOKEN"),
        help="the collector's auth token (default $CHUNKSCOPE_AUTH_TOKEN)",
    )
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait (default 20)")
    args = p.parse_args(argv)
    changes: dict[str, object] = {}
    if args.token_budget is not None:
        changes["token_budget"] = args.token_budget
    if args.policy is not None:
        changes["policy"] = args.policy
    if args.long_prefill_token_threshold is not None:
        changes["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    if not changes:
        p.error(
            "nothing to change: give --token-budget, --policy and/or --long-prefill-token-threshold"
        )
    try:
        ack = send_control(
            args.url,
            args.engine,
            changes,
            token=args.token,
            auth_token=args.auth_token,
            timeout=args.timeout,
        )
    except (OSError, TimeoutError, RuntimeError) as exc:
        print(f"python -m storage control: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(ack))
    return 0 if ack.get("ok") else 1


def run_engines(argv: list[str]) -> int:
    from storage.control import list_engines

    p = argparse.ArgumentParser(
        prog="python -m storage engines",
        description="List the engines the collector has seen (JSON, one per line).",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"collector URL (default {DEFAULT_URL})")
    p.add_argument(
        "--auth-token",
        default=os.environ.get("CHUNKSCOPE_AUTH_TOKEN"),
        help="the collector's auth token (default $CHUNKSCOPE_AUTH_TOKEN)",
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default 10)")
    args = p.parse_args(argv)
    try:
        engines = list_engines(args.url, auth_token=args.auth_token, timeout=args.timeout)
    except (OSError, TimeoutError, RuntimeError) as exc:
        print(f"python -m storage engines: {exc}", file=sys.stderr)
        return 2
    for engine in engines:
        print(json.dumps(engine))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "control":
        return run_control(args[1:])
    if args and args[0] == "engines":
        return run_engines(args[1:])
    if args and args[0] == "export":
        from storage.export import main as export_main

        return export_main(args[1:], prog="python -m storage export")
    if args and args[0] == "collector":
        args = args[1:]
    return run_collector(args)
