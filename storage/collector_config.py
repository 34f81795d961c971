"""The collector's settings: its limits, close codes and ``CollectorConfig``, and the tokens a
connection presents in its handshake."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request

from storage.store import DEFAULT_MAX_RUNS_PER_ENGINE, DEFAULT_RUNS_WINDOW
from storage.writer import DEFAULT_RETRY_DEADLINE, DEFAULT_STALL_AFTER
from wire import credentials
from wire.credentials import EngineCredentials

DEFAULT_PORT = 8765
# The publisher sends at most 1 MiB per frame (a larger event as a placeholder): 4 MiB is room.
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_CONNECTIONS = 256
# Connections to /ingest that have not yet shown a credential (a valid publish token in the
# handshake's Authorization header, or an accepted hello): their own small pool, a few per peer
# address, and a short time to say hello, so that idle sockets never crowd engines or controls out.
DEFAULT_MAX_UNIDENTIFIED = 32
DEFAULT_MAX_UNIDENTIFIED_PER_PEER = 8
DEFAULT_HELLO_TIMEOUT = 3.0
# Of max_connections, this many (at most an eighth) only /control may take, and as many only
# /ingest connections with a credential may take.
RESERVED_CONNECTIONS = 16
# How long a run that left without a goodbye keeps its engine id's control route: its engine
# reconnects within seconds (the publisher's backoff is at most 3 s); an engine restarted after a
# crash is a new run, and gets the route when this is over.
DEFAULT_ROUTE_GRACE = 60.0
MAX_QUEUED_FRAMES = 16  # frames read ahead per connection (websockets' max_queue)
# What waits for the writer, in bytes of frames as received: past it a frame is refused (close
# 1013, not acknowledged) and its engine resends it from the durable seq once it is back
DEFAULT_MAX_PENDING_BYTES = 128 * 1024 * 1024
DEFAULT_MAX_PENDING_EVENTS = 200_000  # ... and in events: past it handlers wait for the writer
MAX_CONTROLS_IN_FLIGHT = 16  # per /control client

CLOSE_TOO_BIG = 1009
CLOSE_AUTH = 4401
CLOSE_NOT_YOURS = 4403  # the hello cannot speak for the run it names (wrong run_secret)
CLOSE_REPLACED = 4409
CLOSE_STORE_ERROR = 1011
CLOSE_BUSY = 1013  # "try again later": too much waits for the writer
CLOSE_TOO_MANY_RUNS = 4429  # the hello's engine id started too many new runs of late


def bearer(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer`` header, if any."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def presented_token(request: Request) -> str | None:
    """The token a /control client presented: ``Authorization: Bearer`` over ``?token=``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return parse_qs(request.path.partition("?")[2]).get("token", [None])[0]


@dataclass
class CollectorConfig:
    db_url: str
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    # Credentials (wire/credentials.py): engines present publish_token in their hello; control
    # clients present control_token when they connect to /control (or in each control message).
    # auth_token is the one token of older releases: it stands in for whichever is not set.
    publish_token: str | None = None
    control_token: str | None = None
    auth_token: str | None = None
    # engine id -> its own tokens (--credentials-file; wire.credentials): a listed engine
    # publishes and is steered only with its own, the others with the shared ones above
    engine_credentials: dict[str, EngineCredentials] = field(default_factory=dict, repr=False)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    control_timeout: float = 15.0
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT  # a new /ingest connection's time to say hello
    # how long a hello waits for the store to register its run (then: close 1011, retry)
    hello_answer_timeout: float = 10.0
    # the writer's op-by-op retries of a failed batch stop after this many seconds in all
    store_retry_deadline: float = DEFAULT_RETRY_DEADLINE
    # /healthz answers 503 once a batch has waited on the store this long
    store_stall_after: float = DEFAULT_STALL_AFTER
    max_pending_events: int = DEFAULT_MAX_PENDING_EVENTS
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    # new runs one engine id may start within runs_window seconds (None: no limit)
    max_runs_per_engine: int | None = DEFAULT_MAX_RUNS_PER_ENGINE
    runs_window: float = DEFAULT_RUNS_WINDOW
    # an engine id's control route stays with the run that held it this long after that run's
    # connection dropped without a goodbye (and after the collector's start, for the run that
    # was connected when it stopped): no other run of the id takes it meanwhile
    route_grace: float = DEFAULT_ROUTE_GRACE
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # /ingest and /control together
    max_unidentified: int = DEFAULT_MAX_UNIDENTIFIED  # /ingest before a credential, in all
    max_unidentified_per_peer: int = DEFAULT_MAX_UNIDENTIFIED_PER_PEER  # ... from one address
    db_connect_timeout: float | None = None  # PostgreSQL; None: storage.db's default
    db_statement_timeout: float | None = None
    # retention (storage.retention): a pass every retention_interval seconds on its own thread
    prune_older_than: float | None = None  # seconds
    prune_max_bytes: int | None = None
    retention_interval: float = 60.0
    prune_max_rows: int = 50_000  # rows deleted per pass at most
    # the fleet (storage.fleet): None joins it on PostgreSQL; advertise_url is the ws:// URL
    # engines and other collectors reach this one at (default: its own listening URL)
    fleet: bool | None = None
    advertise_url: str | None = None

    @property
    def ingest_token(self) -> str | None:
        """What a hello must carry (None: nothing)."""
        return self.publish_token or self.auth_token

    def control_gate(self) -> tuple[str, ...]:
        """The tokens that open a /control connection (empty: open). The legacy auth token
        opens it beside a control token, as before; steering then still needs the control
        token in each message. Each listed engine's own control token opens it too (it then
        lists and steers that engine only)."""
        shared = tuple(t for t in (self.control_token, self.auth_token) if t)
        if not shared:
            return ()
        return shared + tuple(c.control for c in self.engine_credentials.values())

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be from 0 to 65535, got {self.port}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be at least 1024, got {self.max_frame_bytes}")
        if self.control_timeout <= 0:
            raise ValueError(f"control_timeout must be positive, got {self.control_timeout}")
        if not self.route_grace >= 0:
            raise ValueError(f"route_grace must be 0 or more, got {self.route_grace}")
        for name in (
            "hello_answer_timeout",
            "store_retry_deadline",
            "store_stall_after",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_pending_bytes < self.max_frame_bytes:
            raise ValueError(
                f"max_pending_bytes ({self.max_pending_bytes}) must be at least max_frame_bytes "
                f"({self.max_frame_bytes}): one frame of the largest size must fit"
            )
        if self.max_pending_events < 1:
            raise ValueError(
                f"max_pending_events must be at least 1, got {self.max_pending_events}"
            )
        if self.max_runs_per_engine is not None and self.max_runs_per_engine < 1:
            raise ValueError(
                f"max_runs_per_engine must be at least 1, got {self.max_runs_per_engine}"
            )
        if not self.runs_window > 0:
            raise ValueError(f"runs_window must be positive, got {self.runs_window}")
        if not self.hello_timeout > 0:
            raise ValueError(f"hello_timeout must be positive, got {self.hello_timeout}")
        for name in ("max_connections", "max_unidentified", "max_unidentified_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        clash = credentials.clash_with_shared(
            self.engine_credentials, (self.publish_token, self.control_token, self.auth_token)
        )
        if clash:
            raise ValueError(clash)
        if self.prune_older_than is not None and not self.prune_older_than > 0:
            raise ValueError(f"prune_older_than must be positive, got {self.prune_older_than}")
        if self.prune_max_bytes is not None and not self.prune_max_bytes > 0:
            raise ValueError(f"prune_max_bytes must be positive, got {self.prune_max_bytes}")
        if not self.retention_interval > 0:
            raise ValueError(f"retention_interval must be positive, got {self.retention_interval}")
        if self.prune_max_rows < 1:
            raise ValueError(f"prune_max_rows must be at least 1, got {self.prune_max_rows}")
        if self.advertise_url is not None:
            parts = urlsplit(self.advertise_url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme not in ("ws", "wss") or not parts.hostname or port is None:
                raise ValueError(
                    "advertise_url must look like ws://HOST:PORT (how engines and other "
                    f"collectors reach this one), got {self.advertise_url!r}"
                )

    @property
    def reserved(self) -> int:
        """Slots kept for /control, and as many for /ingest with a credential."""
        return min(RESERVED_CONNECTIONS, self.max_connections // 8)

    def publish_tokens(self) -> tuple[str, ...]:
        """The tokens that identify an /ingest connection in its handshake (empty: none)."""
        shared = (self.ingest_token,) if self.ingest_token else ()
        return shared + tuple(c.publish for c in self.engine_credentials.values())
