"""The engine: add requests from any thread, step on one thread (schedule, run, update, emit).

Every time the engine reads is ``time.monotonic_ns()``; ``clock_anchor`` (read once, at
construction) turns them into the wall-clock seconds of ``RequestOutput``. Events reach the
listeners on the step thread in causal order (``engine/step_events.py``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from engine.core.admission import QueueFullError, check_queue, check_request
from engine.core.config import EngineConfig
from engine.core.outputs import EngineStats, RequestOutput
from engine.core.request import ImageInput, Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ControlResult, StepPlan
from engine.model.setup import build_parts, resolve_device, resolve_dtype  # resolve_*: re-export
from engine.step_events import (
    EventBus,
    Listener,
    StepEvents,
    request_event,
    request_output,
    step_event,
)
from wire.events import ClockAnchor, ControlEvent, StepEvent

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    event: StepEvent | None
    outputs: list[RequestOutput] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.clock_anchor = ClockAnchor.now()
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        parts = build_parts(config, self.engine_id)
        self.device = parts.device
        self.dtype = parts.dtype
        self.model_name = parts.model_name
        self.arch = parts.arch
        self.tokenizer = parts.tokenizer
        self.vision = parts.vision
        self.max_model_len = parts.max_model_len
        self.limits = parts.limits
        self.block_manager = parts.block_manager
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self._inbox: deque[tuple[str, object]] = deque()
        self._cond = threading.Condition()
        # Held while scheduling and while applying a control change: a change lands wholly
        # before a step's plan (and its event is emitted before that step) or after it.
        self._control_lock = threading.RLock()
        # The thread that steps (set under _control_lock by step, wait_for_work, flush_events).
        # Only it emits events; until it is known, no step has run, and a control change is
        # emitted at once by the thread that makes it.
        self._step_thread: int | None = None
        self._requests: dict[str, Request] = {}
        self._num_unfinished = 0
        self._bus = EventBus()
        self._stats = EngineStats(
            0,
            0,
            0,
            self.block_manager.num_blocks,
            0,
            config.token_budget,
            config.policy,
            config.long_prefill_token_threshold,
        )

    # --- thread-safe API ----------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    @property
    def policy(self) -> str:
        return self.scheduler.policy

    @property
    def long_prefill_token_threshold(self) -> int:
        return self.scheduler.long_prefill_token_threshold

    @property
    def max_token_budget(self) -> int:
        return self.scheduler.max_token_budget

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event)`` for every event, on the step thread, in causal order."""
        self._bus.add_listener(fn)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        traffic_class: str | None = None,
        images: list[ImageInput] | None = None,
        arrival_time: float | None = None,
        arrival_ns: int | None = None,
    ) -> str:
        """Validate and queue a request; the step loop picks it up at its next step.

        The arrival is now, or ``arrival_ns`` (``time.monotonic_ns()``, exact; on Linux the
        monotonic clock is shared by the processes of a host), or ``arrival_time`` (wall-clock
        seconds, mapped through ``clock_anchor``).
        """
        if arrival_time is not None and arrival_ns is not None:
            raise ValueError("give arrival_time (wall seconds) or arrival_ns (monotonic), not both")
        prompt = check_request(prompt_token_ids, params, images, self.limits)
        if arrival_ns is None:
            arrival_ns = (
                time.monotonic_ns()
                if arrival_time is None
                else self.clock_anchor.to_mono_ns(arrival_time)
            )
        image_id = self.tokenizer.image_token_id
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        req = Request(
            request_id,
            prompt,
            params,
            arrival_ns=arrival_ns,
            traffic_class=traffic_class,
            images=images,
            image_token_id=image_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        with self._cond:
            waiting = self._stats.num_waiting + sum(1 for k, _ in self._inbox if k == "add")
            check_queue(waiting, self.limits)
            self._inbox.append(("add", req))
            self._num_unfinished += 1
            self._cond.notify_all()
        return request_id

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request at the next step. ``reason`` becomes its ``finish_reason`` (in its
        ``aborted`` event and last output): ``"abort"``, or ``"stop"`` when the caller matched a
        stop string."""
        if not isinstance(reason, str):
            raise TypeError(f"abort reason must be a str, got {type(reason).__name__}")
        if not reason:
            raise ValueError("abort reason must not be empty (use 'abort' or 'stop')")
        with self._cond:
            self._inbox.append(("abort", (request_id, reason)))
            self._cond.notify_all()

    def has_unfinished_requests(self) -> bool:
        with self._cond:
            return self._num_unfinished > 0 or bool(self._inbox)

    def wait_for_work(self, timeout: float) -> bool:
        """Step thread, while idle: wait up to ``timeout`` s for requests or aborts. Control
        events held for the step thread are emitted here when there is nothing to step."""
        self._claim_step_thread()
        with self._cond:
            if not (self._num_unfinished > 0 or self._inbox or self._bus.has_held):
                self._cond.wait(timeout)
            has_work = self._num_unfinished > 0 or bool(self._inbox)
        if not has_work:
            self.flush_events()
        return has_work

    def flush_events(self) -> None:
        """Step thread, between steps: emit the control events held since the last step."""
        self._claim_step_thread()
        self._bus.emit(self._bus.take_held())

    def _claim_step_thread(self) -> None:
        me = threading.get_ident()
        if self._step_thread != me:
            with self._control_lock:
                self._step_thread = me

    def stats(self) -> EngineStats:
        """Counts as of the last step; budget, policy and cap as in force now."""
        sch = self.scheduler
        return replace(
            self._stats,
            token_budget=sch.token_budget,
            policy=sch.policy,
            long_prefill_token_threshold=sch.long_prefill_token_threshold,
        )

    def set_token_budget(
        self, value: object, source: str = "api", request_id: str | None = None
    ) -> ControlEvent:
        """Change the token budget from the next step on (any thread). Returns at once; the
        event reaches listeners from the step thread, right before the step it applies at."""
        return self._control(self.scheduler.set_token_budget, value, source, request_id)

    def set_policy(
        self, value: object, source: str = "api", request_id: str | None = None
    ) -> ControlEvent:
        """Change the policy from the next step on (any thread); see ``set_token_budget``."""
        return self._control(self.scheduler.set_policy, value, source, request_id)

    def set_long_prefill_token_threshold(
        self, value: object, source: str = "api", request_id: str | None = None
    ) -> ControlEvent:
        """Change the long-prefill cap (0 = off) from the next step on (any thread); see
        ``set_token_budget``."""
        return self._control(
            self.scheduler.set_long_prefill_token_threshold, value, source, request_id
        )

    def _control(
        self,
        setter: Callable[[object], ControlResult],
        value: object,
        source: str,
        request_id: str | None,
    ) -> ControlEvent:
        with self._control_lock:
            result = setter(value)
            event = ControlEvent(
                key=result.key,
                old_value=result.old_value,
                new_value=result.new_value,
                accepted=result.accepted,
                time_ns=time.monotonic_ns(),
                source=source,
                applied_at_step=result.applied_at_step,
                reason=result.reason,
                request_id=request_id,
            )
            self._bus.hold(event)
            if self._step_thread in (None, threading.get_ident()):
                # between steps on the step thread, or before any step: its place is now
                self._bus.emit(self._bus.take_held())
                emitted = True
            else:
                emitted = False
        if result.accepted:
            logger.info(
                "%s %s -> %s from step %s (%s)",
                result.key,
                result.old_value,
                result.new_value,
                result.applied_at_step,
                source,
            )
        if not emitted:
            with self._cond:  # wake an idle step thread, which emits it
                self._cond.notify_all()
        return event

    # --- the step (engine thread only) --------------------------------------------------------
    def step(self) -> StepResult:
        self._claim_step_thread()
        events = StepEvents()
        outputs: list[RequestOutput] = []
        self._drain_inbox(events, outputs)
        start_ns = time.monotonic_ns()
        with self._control_lock:
            plan = self.scheduler.schedule()
            events.before.extend(self._bus.take_held())
        step = None if plan.is_empty else plan.step
        for req in plan.preempted:
            events.before.append(request_event("preempted", req, start_ns, step))
        if plan.is_empty:
            self._update_stats()
            self._bus.emit(events.ordered(None))
            return StepResult(None, outputs)
        for chunk in plan.chunks:
            req = chunk.request
            if req.first_scheduled_ns is None:
                req.first_scheduled_ns = start_ns
                events.before.append(request_event("first_scheduled", req, start_ns, plan.step))
        try:
            sampled = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - one bad step must not stop the engine
            logger.exception(
                "step %d failed; aborting its %d requests", plan.step, len(plan.chunks)
            )
            self._fail_plan(plan, str(exc), events, outputs)
            self._update_stats()
            self._bus.emit(events.ordered(None))
            return StepResult(None, outputs)
        forward_ns = round(self.runner.last_forward_time * 1e9)
        end_ns = time.monotonic_ns()
        # A request whose sampling or stop check failed fails alone; the step goes on.
        self._fail_requests(plan, getattr(self.runner, "sample_errors", {}), events, outputs)
        stop_failed: dict[str, str] = {}
        produced = self.scheduler.update(plan, sampled, end_ns, stop_failed)
        self._fail_requests(plan, stop_failed, events, outputs)
        for req in produced:
            if req.num_output_tokens == 1:
                events.after.append(request_event("first_token", req, end_ns, plan.step))
            if req.status.finished:
                events.after.append(request_event("finished", req, end_ns, plan.step))
                self._retire(req)
            outputs.append(request_output(req, self.clock_anchor, [req.token_ids[-1]], [end_ns]))
        self._update_stats()
        event = step_event(plan, self._stats, start_ns, end_ns, forward_ns)
        self._bus.emit(events.ordered(event))
        return StepResult(event, outputs)

    def _drain_inbox(self, events: StepEvents, outputs: list[RequestOutput]) -> None:
        with self._cond:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                assert isinstance(item, Request)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
                events.before.append(request_event("arrived", item, item.arrival_ns, None))
            else:
                request_id, reason = item  # type: ignore[misc]
                req = self._requests.get(request_id)
                if req is None or req.status.finished:
                    continue
                self.scheduler.abort(req.request_id)
                req.abort_reason = reason
                now_ns = time.monotonic_ns()
                events.before.append(request_event("aborted", req, now_ns, None))
                self._retire(req)
                outputs.append(request_output(req, self.clock_anchor, [], []))

    def _fail_plan(
        self, plan: StepPlan, error: str, events: StepEvents, outputs: list[RequestOutput]
    ) -> None:
        """The step itself failed (the forward pass): every request of its plan fails."""
        for chunk in plan.chunks:
            if not chunk.request.status.finished:
                self._fail_request(chunk.request, error, plan.step, events, outputs, None)

    def _fail_requests(
        self,
        plan: StepPlan,
        errors: dict[str, str],
        events: StepEvents,
        outputs: list[RequestOutput],
    ) -> None:
        """Fail the requests of the plan named in ``errors`` (request id -> error), each with
        finish reason "error"."""
        for chunk in plan.chunks:
            req = chunk.request
            error = errors.get(req.request_id)
            if error is not None and not req.status.finished:
                logger.warning("request %s failed at step %d: %s", req.request_id, plan.step, error)
                self._fail_request(req, error, plan.step, events, outputs, "error")

    def _fail_request(
        self,
        req: Request,
        error: str,
        step: int,
        events: StepEvents,
        outputs: list[RequestOutput],
        reason: str | None,
    ) -> None:
        """End one request with ``error`` (its last output carries it) and finish reason
        ``reason`` (``None``: "abort")."""
        self.scheduler.abort(req.request_id)
        if reason is not None:
            req.abort_reason = reason
        events.after.append(request_event("aborted", req, time.monotonic_ns(), step))
        self._retire(req)
        outputs.append(request_output(req, self.clock_anchor, [], [], error=error))

    def _retire(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self.runner.release(req)
        with self._cond:
            self._num_unfinished -= 1

    def _update_stats(self) -> None:
        s = self.scheduler
        self._stats = EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            step=s.next_step,
            token_budget=s.token_budget,
            policy=s.policy,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
        )

    # --- offline use --------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams],
    ) -> list[GenerationResult]:
        """Run prompts to completion on this thread; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids: list[str] = []
        for prompt, p in zip(prompts, plist, strict=True):
            tokens = (
                self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else prompt
            )
            ids.append(self.add_request(tokens, p))
        results = {i: GenerationResult(i) for i in ids}
        while self.has_unfinished_requests():
            for out in self.step().outputs:
                r = results.get(out.request_id)
                if r is not None:
                    r.token_ids.extend(out.new_token_ids)
                    r.token_times.extend(out.token_times)
                    r.finish_reason = out.finish_reason
        for r in results.values():
            r.text = self.tokenizer.decode(r.token_ids)
        return [results[i] for i in ids]


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # wall-clock seconds
    finish_reason: str | None = None
    text: str = ""


__all__ = [
    "EngineStats",
    "GenerationResult",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "RequestStatus",
    "StepResult",
    "resolve_device",
    "resolve_dtype",
]
