"""``python -m storage``: the telemetry collector, and two small control clients.

python -m storage [collector] [--host H] [--port P] [--db URL | --data-dir DIR] ...
python -m storage control --url ws://127.0.0.1:8765 --engine ID --token-budget 512
python -m storage engines --url ws://127.0.0.1:8765
python -m storage export --db URL --format chrome-trace|csv|parquet --out PATH
python -m storage prune --db URL [--older-than 7d] [--max-bytes 10G] [--vacuum] [--dry-run]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from storage.db import default_url, masked_url, scrub
from wire import credentials
from wire.ready import collector_ready_line

logger = logging.getLogger(__name__)

DEFAULT_URL = "ws://127.0.0.1:8765"


def _collector_parser(prog: str = "python -m storage") -> argparse.ArgumentParser:
    from storage.collector import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_PENDING_BYTES, DEFAULT_PORT
    from storage.store import DEFAULT_MAX_RUNS_PER_ENGINE, DEFAULT_RUNS_WINDOW

    others = (
        "Steer engines with `chunkscope control`, export with `chunkscope export`, prune with "
        "`chunkscope prune`."
        if prog.startswith("chunkscope")
        else "Other subcommands: `control`, `engines`, `export`, `prune` (see `python -m storage "
        "control --help`)."
    )
    p = argparse.ArgumentParser(
        prog=prog,
        description="Telemetry collector: engines stream step, request and control events to "
        "ws://HOST:PORT/ingest; they are stored in SQLite (WAL) or PostgreSQL. Control clients "
        "use ws://HOST:PORT/control; GET /healthz and /metrics answer on the same port. " + others,
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
        default=credentials.from_env(credentials.DB_URL_ENV),
        help="SQLAlchemy database URL, e.g. sqlite:///data/chunkscope.db or "
        "postgresql+psycopg://user:pw@host/db; a URL with a password is better given as "
        f"${credentials.DB_URL_ENV}, which ps does not show (default: "
        f"${credentials.DB_URL_ENV}, else sqlite:///<data-dir>/chunkscope.db)",
    )
    p.add_argument(
        "--data-dir", default="./data", help="folder of the default SQLite store (default ./data)"
    )
    p.add_argument(
        "--publish-token",
        default=credentials.from_env(credentials.PUBLISH_ENV),
        help="engines must send it in their hello to publish on /ingest; it opens nothing "
        f"else (default: ${credentials.PUBLISH_ENV}, else none)",
    )
    p.add_argument(
        "--control-token",
        default=credentials.from_env(credentials.CONTROL_ENV),
        help="control clients must present it to open /control ('Authorization: Bearer' or "
        "?token=) and to steer; relayed to engines only as a MAC, never itself "
        f"(default: ${credentials.CONTROL_ENV}, else none)",
    )
    p.add_argument(
        "--auth-token",
        default=credentials.from_env(credentials.LEGACY_ENV),
        help="older single token: stands in for --publish-token and opens /control beside "
        f"--control-token (default: ${credentials.LEGACY_ENV}, else none)",
    )
    p.add_argument(
        "--credentials-file",
        default=credentials.from_env(credentials.CREDENTIALS_FILE_ENV),
        metavar="PATH",
        help='engines with tokens of their own: a TOML file ([engines."ID"] publish = '
        '"...", control = "..."; JSON if it ends in .json), read once at start. A listed '
        "engine publishes only with its own publish token and is steered only with its own "
        "control token; the others use the shared tokens "
        f"(default: ${credentials.CREDENTIALS_FILE_ENV}, else none; docs/security.md)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen on an address other than loopback without --publish-token and "
        "--control-token (only on a network you trust; docs/security.md)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=int,
        default=DEFAULT_MAX_FRAME_BYTES,
        help="largest frame accepted in bytes; bigger ones close the connection with 1009 "
        f"(default {DEFAULT_MAX_FRAME_BYTES})",
    )
    p.add_argument(
        "--max-pending-bytes",
        type=_size,
        default=DEFAULT_MAX_PENDING_BYTES,
        metavar="SIZE",
        help="most bytes of received frames that may wait for the store (e.g. 128M); past it a "
        "frame is refused with close 1013, not acknowledged, and its engine resends it later "
        f"(default {DEFAULT_MAX_PENDING_BYTES // (1024 * 1024)}M)",
    )
    p.add_argument(
        "--max-runs-per-engine",
        type=int,
        default=DEFAULT_MAX_RUNS_PER_ENGINE,
        metavar="N",
        help="most new runs one engine id may start within --runs-window; a hello for one more "
        "is refused (close 4429) and stores nothing, a known run always reconnects; 0: no "
        f"limit (default {DEFAULT_MAX_RUNS_PER_ENGINE})",
    )
    p.add_argument(
        "--runs-window",
        type=float,
        default=DEFAULT_RUNS_WINDOW,
        metavar="SECONDS",
        help=f"the window of --max-runs-per-engine (default {DEFAULT_RUNS_WINDOW:g})",
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
    p.add_argument(
        "--prune-older-than",
        type=_age,
        default=None,
        metavar="AGE",
        help="keep the store to this age while running: runs that ended earlier are deleted, "
        "older steps of live runs too (e.g. 7d, 12h; default: keep everything)",
    )
    p.add_argument(
        "--prune-max-bytes",
        "--prune-max-size",
        type=_size,
        default=None,
        metavar="SIZE",
        help="keep the store under this size while running: the oldest ended runs go first, "
        "then the oldest steps of live runs (e.g. 10G, 500M; default: no limit)",
    )
    p.add_argument(
        "--retention-interval",
        type=float,
        default=60.0,
        help="seconds between retention passes (each measures the store for /metrics and "
        "deletes at most 50,000 rows; default 60)",
    )
    p.add_argument(
        "--advertise-url",
        default=None,
        help="the ws://HOST:PORT engines, control clients and Prometheus reach this collector "
        "at, as other collectors of a fleet on the same PostgreSQL list it (default: the "
        "address it listens on)",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def _age(value: str) -> float:
    from storage.retention import parse_age

    try:
        return parse_age(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(value: str) -> int:
    from storage.retention import parse_bytes

    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run_collector(argv: list[str], prog: str = "python -m storage") -> int:
    from storage.collector import Collector, CollectorConfig

    args = _collector_parser(prog).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # one line per connection and HTTP probe is noise at INFO
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.root.level))
    engine_credentials: dict[str, credentials.EngineCredentials] = {}
    if args.credentials_file:
        try:
            engine_credentials = credentials.load_engine_credentials(args.credentials_file)
        except credentials.CredentialsFileError as exc:
            print(f"{prog}: --credentials-file {exc}", file=sys.stderr)
            return 2
        logger.info(  # the ids only, never a token
            "%d engine(s) with credentials of their own: %s",
            len(engine_credentials),
            ", ".join(sorted(engine_credentials)[:20])
            + (" ..." if len(engine_credentials) > 20 else ""),
        )
    missing = {}
    if not (args.publish_token or args.auth_token):
        missing["--publish-token"] = "who may publish"
    if not (args.control_token or args.auth_token):
        missing["--control-token"] = "who may steer"
    refusal = credentials.bind_refusal(
        "the collector", args.host, missing, allowed=args.allow_unauthenticated
    )
    if refusal:
        print(f"{prog}: {refusal}", file=sys.stderr)
        return 2
    try:
        config = CollectorConfig(
            db_url=args.db or default_url(args.data_dir),
            host=args.host,
            port=args.port,
            publish_token=args.publish_token,
            auth_token=args.auth_token,
            control_token=args.control_token,
            engine_credentials=engine_credentials,
            max_frame_bytes=args.max_frame_bytes,
            max_pending_bytes=args.max_pending_bytes,
            max_runs_per_engine=args.max_runs_per_engine or None,
            runs_window=args.runs_window,
            control_timeout=args.control_timeout,
            db_connect_timeout=args.db_connect_timeout,
            db_statement_timeout=args.db_statement_timeout,
            prune_older_than=args.prune_older_than,
            prune_max_bytes=args.prune_max_bytes,
            retention_interval=args.retention_interval,
            advertise_url=args.advertise_url,
        )
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
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
        print(f"{prog}: {scrub(str(exc), config.db_url)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, the data folder cannot be written, ...
        why = scrub(str(exc), config.db_url)
        print(f"{prog}: cannot listen or open the store: {why}", file=sys.stderr)
        return 1
    except Exception as exc:
        from sqlalchemy.exc import SQLAlchemyError

        if not isinstance(exc, SQLAlchemyError):
            raise
        store, why = masked_url(config.db_url), scrub(str(exc), config.db_url)
        print(f"{prog}: cannot open the store {store!r}: {why}", file=sys.stderr)
        return 1
    return 0


def _client_credentials(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control-token",
        default=credentials.from_env(credentials.CONTROL_ENV),
        help=f"the collector's --control-token (default ${credentials.CONTROL_ENV})",
    )
    p.add_argument(
        "--auth-token",
        default=credentials.from_env(credentials.LEGACY_ENV),
        help=f"older collectors' single token (default ${credentials.LEGACY_ENV})",
    )


def run_control(
    argv: list[str],
    prog: str = "python -m storage control",
    engines_prog: str = "python -m storage engines",
) -> int:
    from storage.control import send_control

    p = argparse.ArgumentParser(
        prog=prog,
        description="Change an engine's token budget, policy or long-prefill cap through the "
        "collector; prints "
        "the engine's answer (JSON). Exit status 0 when applied, 1 when refused.",
        epilog=f"`{engines_prog}` lists the engines the collector has seen.",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"collector URL (default {DEFAULT_URL})")
    p.add_argument("--engine", required=True, help=f"engine id (see `{engines_prog}`)")
    p.add_argument("--token-budget", type=int, default=None, help="new token budget per step")
    p.add_argument("--policy", default=None, help="new scheduling policy (chunked, unchunked)")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="new cap on one request's prefill tokens per step while other prompts wait (0: off)",
    )
    _client_credentials(p)
    p.add_argument(
        "--token", default=None, help="older clients: a control token sent in the message itself"
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
            auth_token=args.control_token or args.token or args.auth_token,
            timeout=args.timeout,
        )
    except (OSError, TimeoutError, RuntimeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(ack))
    return 0 if ack.get("ok") else 1


def run_engines(argv: list[str], prog: str = "python -m storage engines") -> int:
    from storage.control import list_engines

    p = argparse.ArgumentParser(
        prog=prog,
        description="List the engines the collector has seen (JSON, one per line).",
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"collector URL (default {DEFAULT_URL})")
    _client_credentials(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default 10)")
    args = p.parse_args(argv)
    try:
        engines = list_engines(
            args.url, auth_token=args.control_token or args.auth_token, timeout=args.timeout
        )
    except (OSError, TimeoutError, RuntimeError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    for engine in engines:
        print(json.dumps(engine))
    return 0


def run_prune(argv: list[str], prog: str = "python -m storage prune") -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from storage import db as dbm
    from storage import retention

    p = argparse.ArgumentParser(
        prog=prog,
        description="Delete old telemetry: by age (runs that ended before it, and older steps "
        "of runs still going) and/or by size (the oldest ended runs, then the oldest steps of "
        "live runs, until the store is at 90% of the limit). Safe beside a running collector: "
        "a connected run keeps its row and its seq; bounded transactions. The freed space is "
        "reused by later writes; --vacuum gives it back to the file system (collector stopped).",
    )
    p.add_argument(
        "--db",
        default=credentials.from_env(credentials.DB_URL_ENV),
        help=f"database URL (default: ${credentials.DB_URL_ENV}, else the --data-dir store)",
    )
    p.add_argument("--data-dir", default="./data", help="folder of the default SQLite store")
    p.add_argument("--older-than", type=_age, default=None, metavar="AGE", help="e.g. 7d, 12h")
    p.add_argument(
        "--max-bytes", "--max-size", type=_size, default=None, metavar="SIZE", help="e.g. 10G"
    )
    p.add_argument(
        "--vacuum",
        action="store_true",
        help="afterwards give the freed space back (SQLite VACUUM, PostgreSQL VACUUM FULL: "
        "exclusive; stop the collector first)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="only print the store's size and what is set"
    )
    args = p.parse_args(argv)
    if args.older_than is None and args.max_bytes is None and not (args.vacuum or args.dry_run):
        p.error("nothing to do: give --older-than and/or --max-bytes (or --vacuum)")
    url = args.db or default_url(args.data_dir)
    try:
        db = dbm.connect(url, readonly=args.dry_run)
        size = retention.store_size(db)
        print(
            f"store {db.url.render_as_string(hide_password=True)}: "
            f"{retention.human_bytes(size.used_bytes)} in use, "
            f"{retention.human_bytes(size.file_bytes)} on disk"
        )
        if args.dry_run:
            return 0
        if dbm.current_revision(db) is None:
            print(f"{prog}: {masked_url(url)!r} holds no chunkscope store", file=sys.stderr)
            return 2
        if args.older_than is not None or args.max_bytes is not None:
            result = retention.prune(db, older_than_s=args.older_than, max_bytes=args.max_bytes)
            print(result.describe())
        if args.vacuum:
            retention.vacuum(db)
            size = retention.store_size(db)
            print(f"vacuumed: {retention.human_bytes(size.file_bytes)} on disk")
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: {scrub(str(exc), url)}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        why = scrub(str(exc).splitlines()[0], url)
        print(f"{prog}: cannot prune {masked_url(url)!r}: {why}", file=sys.stderr)
        return 1
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
    if args and args[0] == "prune":
        return run_prune(args[1:])
    if args and args[0] == "collector":
        args = args[1:]
    return run_collector(args)
