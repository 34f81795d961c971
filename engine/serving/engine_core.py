"""The engine core process: an ``LLMEngine`` and its step loop, driven over two pipes.

Commands come in on one pipe (tuples: ``("add", request_id, prompt, params, traffic_class,
images, arrival_time)``, ``("abort", request_id)``, ``("control", call_id, key, value,
source)``, ``("shutdown",)``). Out on the other goes ``("ready", CoreInfo)`` (or
``("failed", message)``) once, then one ``CoreBatch`` per step: that step's outputs and events,
so the IPC cost is paid per step, not per token. Control replies go out at once, before the
step. The parent going away (EOF on the command pipe) ends the process.

This module imports no torch at import time: the server process unpickles its messages.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from engine.admission import RequestLimits
from engine.config import EngineConfig
from engine.events import ControlEvent, Event
from engine.outputs import EngineStats, RequestOutput

logger = logging.getLogger(__name__)

MAX_COMMANDS_PER_STEP = 1024  # so a flood of commands cannot starve the steps
ERROR_BACKOFF_S = 0.05


@dataclass(frozen=True)
class CoreInfo:
    """What the server process needs to know about the engine, sent once at start-up."""

    pid: int
    engine_id: str
    model_name: str
    max_model_len: int
    max_token_budget: int
    limits: RequestLimits
    tokenizer_folder: str | None  # None: the byte tokenizer
    eos_token_id: int | None
    stats: EngineStats


@dataclass
class CoreBatch:
    """One message from the core: a step's outputs and events, or control replies."""

    stats: EngineStats
    token_budget: int
    policy: str
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    replies: list[tuple[int, ControlEvent]] = field(default_factory=list)
    num_added: int = 0  # add commands taken since the last batch (they count as waiting)
    error: str | None = None  # a step raised: its description
    error_request_id: str | None = None


def run_engine_core(
    config: EngineConfig, commands: Connection, results: Connection, log_level: int
) -> None:
    """The child process's entry: build the engine, report ready, serve commands and steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when to stop
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    try:
        from engine.llm_engine import LLMEngine
        from engine.model.loader import resolve_model

        engine = LLMEngine(config)
        folder = resolve_model(config.model).folder
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses to start
        logger.exception("engine core failed to start")
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    info = CoreInfo(
        pid=os.getpid(),
        engine_id=engine.engine_id,
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        max_token_budget=engine.max_token_budget,
        limits=engine.limits,
        tokenizer_folder=None if engine.tokenizer.hf is None else str(folder),
        eos_token_id=engine.tokenizer.eos_token_id,
        stats=engine.stats(),
    )
    try:
        results.send(("ready", info))
        _Core(engine, commands, results).run()
    except (EOFError, OSError):  # the server process is gone
        logger.info("engine core: server process gone; exiting")
    logger.info("engine core stopped")


class _Core:
    def __init__(self, engine: Any, commands: Connection, results: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.events: list[Event] = []
        self.rejected: list[RequestOutput] = []
        self.num_added = 0
        engine.add_listener(self.events.append)

    def run(self) -> None:
        engine = self.engine
        while True:
            aborted = False
            if self.commands.poll(0 if engine.has_unfinished_requests() else None):
                replies: list[tuple[int, ControlEvent]] = []
                stop, aborted = self._take_commands(replies)
                if replies:
                    self._send(replies=replies)
                if stop:
                    return
            # as in EngineLoop: an abort needs a step to take effect; a control change does not
            if not (aborted or engine.has_unfinished_requests()):
                continue
            try:
                result = engine.step()
            except Exception as exc:  # noqa: BLE001 - the core never dies of one step
                logger.error("engine step failed:\n%s", traceback.format_exc())
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                self._send(error=error, error_request_id=getattr(exc, "request_id", None))
                time.sleep(ERROR_BACKOFF_S)
                continue
            self._send(outputs=result.outputs)

    def _take_commands(self, replies: list[tuple[int, ControlEvent]]) -> tuple[bool, bool]:
        """Apply the commands waiting on the pipe: (shutdown asked, any abort)."""
        engine = self.engine
        aborted = False
        for i in range(MAX_COMMANDS_PER_STEP):
            if i and not self.commands.poll(0):
                break
            cmd = self.commands.recv()
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                engine.abort_request(cmd[1])
                aborted = True
            elif kind == "control":
                _, call_id, key, value, source = cmd
                setter = engine.set_token_budget if key == "token_budget" else engine.set_policy
                replies.append((call_id, setter(value, source)))
            elif kind == "shutdown":
                return True, aborted
            else:
                logger.error("engine core: unknown command %r", kind)
        return False, aborted

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: Any,
        traffic_class: str | None,
        images: list[Any] | None,
        arrival_time: float,
    ) -> None:
        self.num_added += 1
        try:
            self.engine.add_request(
                prompt,
                params,
                request_id=request_id,
                traffic_class=traffic_class,
                images=images,
                arrival_time=arrival_time,
            )
        except Exception as exc:  # noqa: BLE001 - the client checked already; fail just this one
            logger.warning("engine core refused request %s: %s", request_id, exc)
            self.rejected.append(
                RequestOutput(
                    request_id,
                    [],
                    [],
                    True,
                    "abort",
                    len(prompt),
                    0,
                    0,
                    0,
                    traffic_class,
                    arrival_time,
                    None,
                    None,
                    error=str(exc),
                )  # fmt: skip
            )

    def _send(self, *, outputs: list[RequestOutput] | None = None, **fields: Any) -> None:
        engine = self.engine
        batch = CoreBatch(
            stats=engine.stats(),
            token_budget=engine.token_budget,
            policy=engine.policy,
            outputs=[*self.rejected, *(outputs or [])],
            events=self.events[:],
            **fields,
        )
        if "replies" not in fields:  # control replies go out before the step that drains adds
            batch.num_added, self.num_added = self.num_added, 0
        self.rejected.clear()
        self.events.clear()
        self.results.send(batch)
