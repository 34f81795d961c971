"""Where the dashboard gets its data: command-line flags after ``--`` or environment variables.

``streamlit run dashboard`` alone is the embedded default (the dashboard starts its own collector
and engine). ``streamlit run dashboard -- --collector ws://HOST:PORT --db URL`` (or
``CHUNKSCOPE_COLLECTOR_URL`` / ``CHUNKSCOPE_DB_URL``) attaches to a running collector and store.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from wire import credentials

DEFAULT_DATA_DIR = "data"
DEFAULT_MODEL = "demo"
# The embedded engine starts at a large budget, so RAG prompts stall chat streams until the
# budget is lowered from the Control page (the story the dashboard exists to tell).
DEFAULT_TOKEN_BUDGET = 4096
DEFAULT_MAX_TOKEN_BUDGET = 8192


@dataclass(frozen=True)
class Settings:
    collector_url: str | None
    db_url: str | None
    engine_url: str | None
    data_dir: Path
    model: str
    token_budget: int
    max_token_budget: int
    control_token: str | None = field(repr=False)
    engine_threads: int
    publish_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    allow_unauthenticated: bool = False

    @property
    def embedded(self) -> bool:
        """No collector and no store named: start our own."""
        return self.collector_url is None and self.db_url is None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="streamlit run dashboard --",
        description="chunkscope dashboard. Without --collector and --db it starts its own "
        "collector and engine (the embedded default).",
    )
    p.add_argument(
        "--collector",
        default=os.environ.get("CHUNKSCOPE_COLLECTOR_URL"),
        help="collector to attach to, ws://HOST:PORT (env CHUNKSCOPE_COLLECTOR_URL)",
    )
    p.add_argument(
        "--db",
        default=os.environ.get("CHUNKSCOPE_DB_URL"),
        help="the collector's store, a SQLAlchemy URL (env CHUNKSCOPE_DB_URL)",
    )
    p.add_argument(
        "--engine-url",
        default=os.environ.get("CHUNKSCOPE_ENGINE_URL"),
        help="engine HTTP URL the traffic launcher targets in attach mode "
        "(env CHUNKSCOPE_ENGINE_URL)",
    )
    p.add_argument(
        "--data-dir",
        default=os.environ.get("CHUNKSCOPE_DATA_DIR", DEFAULT_DATA_DIR),
        help="embedded mode: folder for the store and the children's logs "
        "(env CHUNKSCOPE_DATA_DIR)",
    )
    p.add_argument(
        "--model",
        default=os.environ.get("CHUNKSCOPE_MODEL", DEFAULT_MODEL),
        help="embedded mode: the engine's model preset or folder (env CHUNKSCOPE_MODEL)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        default=int(os.environ.get("CHUNKSCOPE_TOKEN_BUDGET", DEFAULT_TOKEN_BUDGET)),
        help="embedded mode: the engine's starting token budget",
    )
    p.add_argument(
        "--max-token-budget",
        type=int,
        default=DEFAULT_MAX_TOKEN_BUDGET,
        help="embedded mode: the highest budget a live change may set",
    )
    p.add_argument(
        "--engine-threads",
        type=int,
        default=int(os.environ.get("CHUNKSCOPE_ENGINE_THREADS", default_engine_threads())),
        help="embedded mode: torch threads of the engine (default: all cores but one, which "
        "the dashboard and the browser need; env CHUNKSCOPE_ENGINE_THREADS)",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve the dashboard on an address other than loopback (it has no login: anyone "
        "who reaches it can steer the engines; docs/security.md)",
    )
    return p


def bind_refusal(address: str | None, settings: Settings) -> str:
    """Why this dashboard may not serve on Streamlit's ``server.address`` ("" when it may).
    None (Streamlit's default when no flag or config sets it) listens on every interface. The
    dashboard has no login, so only loopback is safe without ``--allow-unauthenticated``."""
    why = credentials.bind_refusal(
        "the dashboard",
        address or "",
        {"--server.address 127.0.0.1": "the dashboard has no login of its own"},
        allowed=settings.allow_unauthenticated,
    )
    if why:
        why += (
            "; e.g. `streamlit run dashboard --server.address 127.0.0.1` (the repository's "
            ".streamlit/config.toml sets it when run from the repository root)"
        )
    return why


def default_engine_threads() -> int:
    """All cores but one. OpenMP threads wait for each other at every operation: with as many
    threads as cores and a browser drawing charts on one of them, every step waits for a thread
    that is not running (measured on 2 cores: 256-token steps went from ~30 ms to 1-2 s)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, n - 1)


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Flags (when ``argv`` is given) over environment variables over defaults.

    Raises ValueError for an unusable combination (e.g. a store without a collector is fine,
    read-only; a collector without a store is not: there would be nothing to draw).
    """
    args = build_parser().parse_args(argv or [])
    collector = args.collector or None
    db = args.db or None
    if collector is not None and db is None:
        raise ValueError(
            "attach mode needs the store too: add --db URL (or set CHUNKSCOPE_DB_URL) "
            "next to --collector"
        )
    if collector is not None and not collector.startswith(("ws://", "wss://")):
        raise ValueError(f"--collector must look like ws://HOST:PORT, got {collector!r}")
    if args.token_budget < 1 or args.token_budget > args.max_token_budget:
        raise ValueError(
            f"--token-budget must be from 1 to --max-token-budget ({args.max_token_budget}), "
            f"got {args.token_budget}"
        )
    if args.engine_threads < 1:
        raise ValueError(f"--engine-threads must be >= 1, got {args.engine_threads}")
    return Settings(
        collector_url=collector,
        db_url=db,
        engine_url=args.engine_url or None,
        data_dir=Path(args.data_dir).expanduser().resolve(),
        model=args.model,
        token_budget=args.token_budget,
        max_token_budget=args.max_token_budget,
        # Credentials from the environment only (flags would show in ps), passed on to the
        # children and clients that need each one (wire/credentials.py).
        control_token=credentials.from_env(credentials.CONTROL_ENV, legacy=True),
        engine_threads=args.engine_threads,
        publish_token=credentials.from_env(credentials.PUBLISH_ENV, legacy=True),
        api_key=credentials.from_env(credentials.API_KEY_ENV),
        allow_unauthenticated=args.allow_unauthenticated,
    )
