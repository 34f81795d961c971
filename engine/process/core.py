"""The engine core: an ``LLMEngine`` and its step loop, driven by commands over a channel.

One loop for every transport (``serving.transport``): the core runs in a child process behind two
pipes (the default) or on a thread behind two in-process queues (tests, embedding); either way it
sees only the two channel ends. In the child process a thread reads the commands off the pipe as
they are sent (``channels.read_ahead``), and before each step the loop takes every command that has
arrived: a request sent before a step starts is in it, however long the step before it was.

Commands in (tuples): ``("add", request_id, prompt, params, traffic_class, images,
arrival_ns)`` (``time.monotonic_ns()`` read in the server process: one clock per host on
Linux), ``("abort", request_id, reason)``, ``("control", call_id, changes, source,
request_id)``, ``("shutdown",)``. Out goes ``("ready", CoreInfo)`` (or ``("failed", message)``)
once, then ``CoreBatch`` messages: after taking commands, one with the answers (each add
admitted or refused with its kind, control replies), sent before the step so a refusal reaches
the client before any output; after each step, one with that step's outputs and events, so the
IPC cost is paid per step, not per token. End of the command channel (the server went away)
ends the loop.

This module imports no torch at import time: the server process unpickles its messages.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.admission import QueueFullError, RequestLimits
from engine.core.config import EngineConfig
from engine.core.outputs import EngineStats, RequestOutput
from engine.process.channels import read_ahead
from engine.process.control import apply_changes, takes_keyword
from engine.process.steptrace import StepTracer
from wire.control import ControlRefused
from wire.events import ControlEvent, Event

logger = logging.getLogger(__name__)

MAX_COMMANDS_PER_STEP = 1024  # so a flood of commands cannot starve the steps
ERROR_BACKOFF_S = 0.05


class Channel(Protocol):
    """One end of a one-way message channel (``multiprocessing.connection.Connection`` or
    ``channels.QueueChannel``): ``recv`` raises EOFError once the other end is closed."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know about the engine, sent once at start-up."""

    pid: int
    engine_id: str
    model_name: str
    max_model_len: int
    max_token_budget: int
    limits: RequestLimits
    tokenizer_folder: str | None  # None: the byte tokenizer
    eos_token_id: int | None
    stats: EngineStats
    clock_anchor: Any = None  # the engine's ClockAnchor: maps its monotonic times to wall time
    cpu_threads: int | None = None  # torch intra-op threads of the process that steps


@dataclass(frozen=True)
class Admission:
    """The core's answer to one add: admitted (``refusal`` None) or refused, with its kind
    (``queue_full``, ``invalid``, ``error``) and message."""

    request_id: str
    refusal: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class ControlReply:
    """The answer to one control command: the engine's events, or why it was refused."""

    call_id: int
    events: list[ControlEvent] = field(default_factory=list)
    refused: str | None = None
    param: str | None = None


@dataclass
class CoreBatch:
    """One message from the core: answers to commands, or a step's outputs and events."""

    stats: EngineStats
    token_budget: int
    policy: str
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    replies: list[ControlReply] = field(default_factory=list)
    num_added: int = 0  # adds admitted since the last step batch (they count as waiting)
    error: str | None = None  # a step raised: its description
    error_request_id: str | None = None
    long_prefill_token_threshold: int = 0


def core_info(engine: Any, tokenizer_folder: str | None) -> CoreInfo:
    return CoreInfo(
        pid=os.getpid(),
        engine_id=engine.engine_id,
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        max_token_budget=engine.max_token_budget,
        limits=engine.limits,
        tokenizer_folder=tokenizer_folder if engine.tokenizer.hf is not None else None,
        eos_token_id=engine.tokenizer.eos_token_id,
        stats=engine.stats(),
        clock_anchor=getattr(engine, "clock_anchor", None),
        cpu_threads=_torch_threads(),
    )


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")  # imported by the engine, never here
    return int(torch.get_num_threads()) if torch is not None else None


def run_core_process(
    config: EngineConfig, commands: Channel, results: Channel, log_level: int
) -> None:
    """The child process's entry: build the engine, report ready, run the core loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process decides when to stop
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    try:
        from engine.llm_engine import LLMEngine
        from engine.model.loader import resolve_model

        engine = LLMEngine(config)
        folder = str(resolve_model(config.model).folder)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which refuses to start
        logger.exception("engine core failed to start")
        results.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    freeze_startup_objects()
    # commands are read off the pipe as they come, not between steps (``channels.read_ahead``)
    inbox = read_ahead(commands, name="chunkscope-core-rx")
    serve_engine(engine, inbox, results, core_info(engine, folder))


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now (torch, the model, the app: ~200,000 in
    the engine core) out of the garbage collector's reach. A full collection would otherwise
    walk them all, 100-200 ms with the step (or the token stream) stopped; after the freeze it
    walks only what serving created since."""
    gc.collect()
    gc.freeze()


def serve_engine(engine: Any, commands: Channel, results: Channel, info: CoreInfo) -> None:
    """Report ``info`` as ready, then run the core loop until shutdown or the end of
    ``commands``; ``results`` is closed on the way out (the client sees EOF)."""
    try:
        results.send(("ready", info))
        EngineCore(engine, commands, results).run()
    except (EOFError, OSError):  # the server is gone
        logger.info("engine core: server gone; exiting")
    finally:
        results.close()
    logger.info("engine core stopped")


class EngineCore:
    """The step loop: take commands, answer them, step while there is work, send results."""

    def __init__(self, engine: Any, commands: Channel, results: Channel) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.events: list[Event] = []
        self.admissions: list[Admission] = []
        self.replies: list[ControlReply] = []
        self.num_added = 0
        self._abort_takes_reason = takes_keyword(engine.abort_request, "reason")
        self._add_takes_ns = takes_keyword(engine.add_request, "arrival_ns")
        self._running = True
        self.tracer = StepTracer.from_env()
        engine.add_listener(self._collect)

    def _collect(self, event: Event) -> None:
        if self._running:  # an engine may outlive its core (a test serves it again)
            self.events.append(event)

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self._running = False
            if self.tracer is not None:
                self.tracer.close()

    def _loop(self) -> None:
        engine = self.engine
        tracer = self.tracer
        while True:
            aborted = False
            if self.commands.poll(0 if engine.has_unfinished_requests() else None):
                stop, aborted = self._take_commands()
                if self.admissions or self.replies:
                    self._send(after_step=False)
                if stop:
                    return
            # an abort needs a step to take effect (and to free its blocks)
            if not (aborted or engine.has_unfinished_requests()):
                continue
            if tracer is not None:
                tracer.begin()
            try:
                result = engine.step()
            except Exception as exc:  # noqa: BLE001 - the core never dies of one step
                logger.error("engine step failed:\n%s", traceback.format_exc())
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                rid = getattr(exc, "request_id", None)
                self._send(after_step=True, error=error, error_request_id=rid)
                time.sleep(ERROR_BACKOFF_S)
                continue
            if tracer is None:
                self._send(after_step=True, outputs=result.outputs)
                continue
            t0 = time.monotonic_ns()
            self._send(after_step=True, outputs=result.outputs)
            ev = result.event
            tracer.end(
                ev.step if ev is not None else None,
                send_ns=time.monotonic_ns() - t0,
                prefill_tokens=ev.num_prefill_tokens if ev is not None else None,
                decode_tokens=ev.num_decode_tokens if ev is not None else None,
            )

    def _take_commands(self) -> tuple[bool, bool]:
        """Apply the commands waiting on the channel: (shutdown asked, any abort)."""
        aborted = False
        for i in range(MAX_COMMANDS_PER_STEP):
            if i and not self.commands.poll(0):
                break
            cmd = self.commands.recv()
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                self._abort(cmd[1], cmd[2])
                aborted = True
            elif kind == "control":
                self._control(*cmd[1:])
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
        arrival_ns: int,
    ) -> None:
        arrival: dict[str, Any] = (
            {"arrival_ns": arrival_ns}
            if self._add_takes_ns
            else {"arrival_time": time.time() - (time.monotonic_ns() - arrival_ns) / 1e9}
        )
        try:
            self.engine.add_request(
                prompt,
                params,
                request_id=request_id,
                traffic_class=traffic_class,
                images=images,
                **arrival,
            )
        except QueueFullError as exc:  # the server's count was a step old
            self.admissions.append(Admission(request_id, "queue_full", str(exc)))
        except (ValueError, TypeError) as exc:
            self.admissions.append(Admission(request_id, "invalid", str(exc)))
        except Exception as exc:  # noqa: BLE001 - fail just this one
            logger.exception("engine core could not add request %s", request_id)
            self.admissions.append(Admission(request_id, "error", f"{type(exc).__name__}: {exc}"))
        else:
            self.num_added += 1
            self.admissions.append(Admission(request_id))

    def _abort(self, request_id: str, reason: str | None) -> None:
        if reason is not None and self._abort_takes_reason:
            self.engine.abort_request(request_id, reason=reason)
        else:
            self.engine.abort_request(request_id)

    def _control(
        self, call_id: int, changes: dict[str, object], source: str, request_id: str | None
    ) -> None:
        try:
            events = apply_changes(self.engine, changes, source, request_id)
        except ControlRefused as exc:
            self.replies.append(ControlReply(call_id, refused=exc.reason, param=exc.param))
        except Exception as exc:  # noqa: BLE001 - answer the caller, keep serving
            logger.exception("engine core: control %s failed", changes)
            self.replies.append(ControlReply(call_id, refused=f"{type(exc).__name__}: {exc}"))
        else:
            self.replies.append(ControlReply(call_id, events=events))

    def _send(
        self, *, after_step: bool, outputs: list[RequestOutput] | None = None, **kw: Any
    ) -> None:
        engine = self.engine
        batch = CoreBatch(
            stats=engine.stats(),
            token_budget=engine.token_budget,
            policy=engine.policy,
            long_prefill_token_threshold=engine.long_prefill_token_threshold,
            outputs=outputs or [],
            events=self.events[:],
            admissions=self.admissions[:],
            replies=self.replies[:],
            **kw,
        )
        if after_step:  # the step took the adds: from now on the stats count them as waiting
            batch.num_added, self.num_added = self.num_added, 0
        self.events.clear()
        self.admissions.clear()
        self.replies.clear()
        self.results.send(batch)
