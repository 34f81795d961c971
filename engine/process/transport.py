"""Where the engine core runs, and the two channels that reach it.

``ProcessTransport`` (the default) spawns the core in a daemon child process behind two pipes, so
the steps and the HTTP event loop hold separate GILs (vLLM V1's split). ``ThreadTransport`` runs
the same core loop on a thread behind two in-process queues: for tests that inspect or patch the
``LLMEngine`` object, and for embedding. The client (``serving.client``) sees only this interface:
``commands`` to send on, ``results`` to receive from, ``is_alive``, ``stop``, ``kill``,
``describe_exit``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
from typing import Any

from engine.core.config import EngineConfig
from engine.process.channels import QueueChannel
from engine.process.core import Channel, core_info, run_core_process, serve_engine

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; the CPU count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_core_threads(cpus: int | None = None) -> int:
    """torch intra-op threads for an engine core behind a server: every usable CPU but one.

    The core's parallel regions (matmuls, attention) split work evenly over their threads and
    end when the slowest thread does. The HTTP process (streams, detokenizing, telemetry) and
    the clients on the same host need CPU after every step; with a thread per CPU they preempt
    one of the core's threads mid-region and the whole step waits for it (and a spinning
    sibling takes CPU from the server in turn). One CPU left to them keeps a step's time its
    work's (vLLM's CPU backend reserves a CPU for its API server for the same reason).
    """
    n = usable_cpus() if cpus is None else cpus
    return max(1, n - 1)


class ProcessTransport:
    """The engine core in a spawned daemon child process (the server's default)."""

    kind = "process"

    def __init__(self, config: EngineConfig, *, log_level: int | None = None) -> None:
        config = config.validate()
        if config.cpu_threads is None:  # leave a CPU to the server process
            config = dataclasses.replace(config, cpu_threads=default_core_threads())
        self.config = config
        self.engine: Any = None  # lives in the child
        self.tokenizer: Any = None  # the client builds its own from CoreInfo
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self.commands = ctx.Pipe(duplex=False)
        self.results, res_send = ctx.Pipe(duplex=False)
        level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        self._proc = ctx.Process(
            target=run_core_process,
            args=(config, cmd_recv, res_send, level),
            name="chunkscope-engine-core",
            daemon=True,
        )
        self._proc.start()
        cmd_recv.close()  # the child holds the only copies: its exit is EOF here
        res_send.close()

    @property
    def pid(self) -> int:
        return int(self._proc.pid or 0)

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self, timeout: float) -> None:
        """Wait for the child (asked to shut down) to exit; terminate, then kill it."""
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("engine core did not stop within %.1f s; terminating it", timeout)
            self.kill()

    def kill(self) -> None:
        self._proc.terminate()
        self._proc.join(2)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(2)

    def describe_exit(self) -> str:
        self._proc.join(2)
        code = self._proc.exitcode
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
        )
        return f"the engine core process (pid {self.pid}) died: {how}"


class ThreadTransport:
    """The engine core on a thread of this process, over in-process queues.

    ``engine`` is an ``LLMEngine`` (kept, so tests can inspect or patch it) or an
    ``EngineConfig`` to build one from.
    """

    kind = "thread"

    def __init__(self, engine: Any) -> None:
        if isinstance(engine, EngineConfig):
            from engine.llm_engine import LLMEngine

            engine = LLMEngine(engine)
        from engine.model.loader import resolve_model

        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.commands: Channel = QueueChannel()
        self.results: Channel = QueueChannel()
        folder = str(resolve_model(engine.config.model).folder)
        self._thread = threading.Thread(
            target=serve_engine,
            args=(engine, self.commands, self.results, core_info(engine, folder)),
            name="chunkscope-engine-core",
            daemon=True,
        )
        self._thread.start()

    @property
    def pid(self) -> int:
        import os

        return os.getpid()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine core thread did not stop within %.1f s", timeout)

    def kill(self) -> None:
        """A thread cannot be killed: end its command channel; it exits after its step."""
        self.commands.close()

    def describe_exit(self) -> str:
        return "the engine core thread stopped"
