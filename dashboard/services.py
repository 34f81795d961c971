"""The processes behind the dashboard: the embedded stack (collector + engine) or an attached
collector and store, and the traffic launcher (a ``python -m loadgen`` run).

One :class:`Stack` and one :class:`TrafficLauncher` per Streamlit server process (the app keeps
them with ``st.cache_resource``), shared by every browser session. Nothing here imports
Streamlit, so tests drive it directly.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dashboard.processes import ManagedProcess, python_argv
from dashboard.settings import Settings
from loadgen.profiles import MAX_CHAT_USERS
from loadgen.saturation import RATIO as OVERLOAD_RATIO
from loadgen.shapes import CHOICES as SHAPE_CHOICES
from loadgen.shapes import DEMO_MODELS, background_rate, background_users, shaped_profiles
from wire import credentials
from wire.ready import COLLECTOR_READY, ENGINE_READY

logger = logging.getLogger(__name__)

COLLECTOR_START_TIMEOUT_S = 60.0
ENGINE_START_TIMEOUT_S = 180.0


class Stack:
    """Collector URL, store URL and engine URL, and (embedded) the children that serve them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.collector: ManagedProcess | None = None
        self.engine: ManagedProcess | None = None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._collector_url = settings.collector_url
        self._db_url = settings.db_url
        self._engine_url = settings.engine_url
        self._engine_collector: str | None = None  # the collector URL the engine was given
        self._lock_file: Any = None
        if settings.embedded:
            self._db_url = f"sqlite:///{settings.data_dir / 'chunkscope.db'}"

    @property
    def embedded(self) -> bool:
        return self.settings.embedded

    @property
    def collector_url(self) -> str | None:
        return self._collector_url

    @property
    def db_url(self) -> str | None:
        return self._db_url

    @property
    def engine_url(self) -> str | None:
        return self._engine_url

    @property
    def starting(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Stack:
        """Embedded mode: bring the collector, then the engine, up on a background thread (the
        page shows their state meanwhile). Attach mode: nothing to start."""
        if not self.embedded:
            return self
        with self._lock:
            if self.starting:
                return self
            self.error = None
            self._thread = threading.Thread(
                target=self._bring_up, name="dashboard-stack", daemon=True
            )
            self._thread.start()
        return self

    def wait_started(self, timeout: float) -> bool:
        """True when the start finished (up or failed) within ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.starting

    def _lock_data_dir(self) -> None:
        """One embedded dashboard per data folder (two would run two collectors on one store):
        an exclusive ``flock`` held for the life of the process."""
        if self._lock_file is not None:
            return
        path = self.settings.data_dir / ".dashboard.lock"
        f = open(path, "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise RuntimeError(
                f"another dashboard (pid {holder}) runs an embedded stack in {path.parent}; "
                "stop it, attach to its collector (--collector, --db), or give --data-dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f

    def _bring_up(self) -> None:
        s = self.settings
        logs = s.data_dir / "logs"
        try:
            s.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock_data_dir()
            if self.collector is None or not self.collector.alive():
                self.collector = ManagedProcess(
                    "collector",
                    python_argv(
                        "storage",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--data-dir",
                        str(s.data_dir),
                    ),
                    logs / "collector.log",
                    nice=INSTRUMENT_NICE,
                ).start(
                    # the store's URL in the environment, not as --db: ps shows a command line
                    env=child_env(
                        publish=s.publish_token, control=s.control_token, db_url=self._db_url
                    )
                )
                self._collector_url = self.collector.wait_ready(
                    COLLECTOR_READY, COLLECTOR_START_TIMEOUT_S
                )
            if (
                self.engine is not None
                and self.engine.alive()
                and self._engine_collector != self._collector_url
            ):
                # the collector came back on another port: an engine left publishing to the
                # old one would spill and drop its events; start it again pointed at the new one
                logger.info(
                    "collector moved %s -> %s: restarting the engine",
                    self._engine_collector,
                    self._collector_url,
                )
                self.engine.stop()
            if self.engine is None or not self.engine.alive():
                self._engine_collector = self._collector_url
                self.engine = ManagedProcess(
                    "engine",
                    python_argv(
                        "engine",
                        "--model",
                        s.model,
                        "--host",
                        "127.0.0.1",
                        "--port",
                        "0",
                        "--token-budget",
                        str(s.token_budget),
                        "--max-token-budget",
                        str(s.max_token_budget),
                        "--collector-url",
                        str(self._collector_url),
                    ),
                    logs / "engine.log",
                ).start(
                    env={
                        "OMP_NUM_THREADS": str(s.engine_threads),
                        **child_env(
                            publish=s.publish_token, control=s.control_token, api_key=s.api_key
                        ),
                    }
                )
                self._engine_url = self.engine.wait_ready(ENGINE_READY, ENGINE_START_TIMEOUT_S)
        except (OSError, RuntimeError) as exc:
            self.error = str(exc)
            logger.error("embedded stack did not start: %s", exc)

    def restart(self) -> Stack:
        """Start again whatever child is not running (the store keeps its data)."""
        return self.start()

    def stop(self) -> None:
        for child in (self.engine, self.collector):
            if child is not None:
                child.stop()

    def children(self) -> list[ManagedProcess]:
        return [c for c in (self.collector, self.engine) if c is not None]

    def describe(self) -> list[dict[str, Any]]:
        """One row per child for the sidebar (embedded mode)."""
        return [
            {"process": c.name, "state": c.state, "pid": c.pid, "address": c.url or ""}
            for c in self.children()
        ]


SECRET_ENVS = {
    "publish": credentials.PUBLISH_ENV,
    "control": credentials.CONTROL_ENV,
    "api_key": credentials.API_KEY_ENV,
    "openai_api_key": "OPENAI_API_KEY",
    "db_url": credentials.DB_URL_ENV,  # a PostgreSQL URL may hold a password
}


def child_env(**given: str | None) -> dict[str, str | None]:
    """The credential variables of a child: those ``given`` (publish, control, api_key,
    openai_api_key, db_url) set, every other one (and the older single token) removed, so no
    child inherits a secret it does not need."""
    unknown = set(given) - set(SECRET_ENVS)
    if unknown:
        raise TypeError(f"unknown credentials {sorted(unknown)}")
    env: dict[str, str | None] = {credentials.LEGACY_ENV: None}
    for name, var in SECRET_ENVS.items():
        env[var] = given.get(name) or None
    return env


# The load generator and the collector run this much nicer than the engine they load and record:
# on two cores the engine's steps, which every figure measures, get the CPU first
INSTRUMENT_NICE = 5


@dataclass(frozen=True)
class TrafficProfile:
    """A launcher preset: a loadgen profile, its rate and the chat beside it."""

    profile: str
    rate: float
    background: float  # req/s of open-loop chat beside the profile's requests (loadgen's default)
    users: int = 0  # closed-loop chat users beside them: the streams a long prompt stalls


def _presets(shapes: str = "demo") -> dict[str, TrafficProfile]:
    """The launcher's presets from loadgen's named shape set (one copy of every number)."""
    p = shaped_profiles(shapes)
    return {
        name: TrafficProfile(
            name,
            float(getattr(p, name).rate),
            background_rate(name, None, p, trace=False),
            background_users(name, None, p, trace=False),
        )
        for name in ("mixed", "rag", "vlm", "chat")
    }


# Sized for the CPU `demo` engine on two cores (loadgen/shapes.py): chat streams stay below
# saturation at any budget while each RAG prompt (thousands of tokens) or image is a step lasting
# up to seconds at a large budget, which every chat stream in flight waits for. `rag` and `vlm`
# carry chat users (the streams to be stalled, several in flight at any moment); `mixed` has
# chat, RAG and images, and the same chat users beside them.
PROFILES: dict[str, TrafficProfile] = _presets("demo")
DEFAULT_DURATION_S = 120.0


def launcher_shapes(model: str | None) -> str:
    """The shape set the launcher names: ``demo`` against a demo-sized preset it started itself,
    else ``auto`` (loadgen asks the server which model it serves)."""
    return "demo" if (model or "").lower() in DEMO_MODELS else "auto"


def loadgen_argv(
    url: str,
    profile: str,
    *,
    rate: float,
    duration: float,
    seed: int,
    out: Path,
    background: float | None = None,
    users: int | None = None,
    shapes: str = "demo",
) -> list[str]:
    """The ``python -m loadgen`` command line of a launcher run (validated here).
    ``background``: req/s of open-loop chat beside the profile's requests, ``users``: closed-loop
    chat users beside them (None: the preset's)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not duration > 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine URL must look like http://HOST:PORT, got {url!r}")
    if background is None:
        background = PROFILES[profile].background
    if not background >= 0:
        raise ValueError(f"chat background must be >= 0 requests/s, got {background}")
    if users is None:
        users = PROFILES[profile].users
    if not 0 <= users <= MAX_CHAT_USERS:
        raise ValueError(f"chat users must be in 0..{MAX_CHAT_USERS}, got {users}")
    if shapes not in SHAPE_CHOICES:
        raise ValueError(f"shapes must be one of {', '.join(SHAPE_CHOICES)}, got {shapes!r}")
    return python_argv(
        "loadgen",
        "--url",
        url,
        "--profile",
        profile,
        "--shapes",
        shapes,
        "--rate",
        f"{rate:g}",
        "--chat-background",
        f"{background:g}",
        "--chat-users",
        str(int(users)),
        "--duration",
        f"{duration:g}",
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--no-progress",
    )


SERVED_WINDOW_S = 60.0


def overload_message(offered_rps: float, finished: float, window_s: float) -> str | None:
    """A warning when the offered load is more than the engine served: ``finished`` requests
    over the last ``window_s`` seconds (from the store), None while it keeps up."""
    if window_s <= 0 or offered_rps <= 0:
        return None
    served = finished / window_s
    if offered_rps <= OVERLOAD_RATIO * served:
        return None
    return (
        f"Offered {offered_rps:.2f} req/s, but the engine finished {served:.2f} req/s over the "
        f"last {window_s:.0f} s: it cannot keep up, so queueing, not the budget, will dominate "
        "the latencies. Lower the rate or the chat background."
    )


class TrafficLauncher:
    """At most one load generator run at a time, started and stopped from the sidebar."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.run: ManagedProcess | None = None
        self.description = ""
        self.offered_rps = 0.0  # the running load's total req/s (profile + chat background)
        self.started_at: float | None = None  # wall time of the last start
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def running(self) -> bool:
        return self.run is not None and self.run.alive()

    def start(
        self,
        url: str,
        profile: str,
        *,
        rate: float,
        duration: float,
        seed: int = 0,
        background: float | None = None,
        users: int | None = None,
        shapes: str = "demo",
        api_key: str | None = None,
    ) -> None:
        """``api_key``: the engine's ``--api-key``, handed to loadgen as ``$OPENAI_API_KEY``
        (never on its command line)."""
        with self._lock:
            if self.running:
                raise RuntimeError("a load run is already going: stop it first")
            if background is None:
                background = PROFILES[profile].background if profile in PROFILES else 0.0
            if users is None:
                users = PROFILES[profile].users if profile in PROFILES else 0
            self._seq += 1
            stamp = time.strftime("%Y%m%d-%H%M%S")
            out = self.data_dir / "loadgen" / f"{stamp}-{profile}-{self._seq}.json"
            argv = loadgen_argv(
                url,
                profile,
                rate=rate,
                duration=duration,
                seed=seed,
                out=out,
                background=background,
                users=users,
                shapes=shapes,
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            self.run = ManagedProcess(
                "loadgen", argv, out.with_suffix(".log"), nice=INSTRUMENT_NICE
            ).start(env=child_env(openai_api_key=api_key))
            self.offered_rps = rate + background
            self.started_at = time.time()
            extra = f" + {users} chat users" if users else ""
            extra += f" + chat background {background:g} req/s" if background else ""
            self.description = (
                f"{profile} at {rate:g} req/s{extra} for {duration:g} s (shapes {shapes}) → {url}"
            )

    def stop(self) -> None:
        """Interrupt the run like Ctrl-C (loadgen then writes what it has), kill if it lingers."""
        import signal

        with self._lock:
            if self.run is not None:
                self.run.stop(grace=10.0, sig=signal.SIGINT)

    def state(self) -> str:
        if self.run is None:
            return "idle"
        if self.running:
            return f"running: {self.description}"
        rc = self.run.returncode
        word = "stopped" if self.run.stopped else ("done" if rc == 0 else f"exited ({rc})")
        return f"{word}: {self.description}"
