"""Building the engine's events and outputs, and handing them to listeners in causal order.

The step thread collects each step's events in a :class:`StepEvents` and emits them in this order
(see ``docs/telemetry.md``, "Order in the event stream"):

1. before the step: ``arrived`` and ``aborted`` (from the inbox), the ``control`` events that
   apply at this step, ``preempted``, ``first_scheduled``;
2. the ``step`` event;
3. after the step: ``first_token``, ``finished``.

Control changes arrive on other threads; :class:`EventBus` keeps them pending until the step
thread emits them (at the next step, or at once when the engine is idle), so the listeners see
every event from the step thread, in one order. No torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.core.outputs import EngineStats, RequestOutput
from engine.core.request import Request
from engine.core.scheduler import StepPlan
from wire.events import ChunkRecord, ClockAnchor, ControlEvent, Event, RequestEvent, StepEvent

logger = logging.getLogger(__name__)

Listener = Callable[[Event], None]


@dataclass
class StepEvents:
    """One step's events, by their place around the ``step`` event."""

    before: list[Event] = field(default_factory=list)
    after: list[Event] = field(default_factory=list)

    def ordered(self, step: StepEvent | None) -> list[Event]:
        return [*self.before, *([step] if step is not None else []), *self.after]


class EventBus:
    """Listeners, and the control events waiting for the step thread.

    ``emit`` runs the listeners on the calling thread; the engine calls it from its step thread
    only. ``hold`` (any thread) queues a control event; ``take_held`` (step thread) returns the
    queued ones in the order they were held.
    """

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._held: list[ControlEvent] = []
        self._lock = threading.Lock()

    def add_listener(self, fn: Listener) -> None:
        self._listeners.append(fn)

    def hold(self, event: ControlEvent) -> None:
        with self._lock:
            self._held.append(event)

    @property
    def has_held(self) -> bool:
        return bool(self._held)

    def take_held(self) -> list[ControlEvent]:
        with self._lock:
            held, self._held = self._held, []
        return held

    def emit(self, events: Iterable[Event]) -> None:
        for event in events:
            for fn in self._listeners:
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 - an observer never stops the engine
                    logger.exception("event listener %r failed", fn)


def request_event(kind: str, req: Request, t_ns: int, step: int | None) -> RequestEvent:
    return RequestEvent(
        kind=kind,
        request_id=req.request_id,
        time_ns=t_ns,
        traffic_class=req.traffic_class,
        num_prompt_tokens=req.num_prompt_tokens,
        num_image_tokens=req.num_image_tokens,
        num_output_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        finish_reason=req.finish_reason,
        step=step,
    )


def step_event(
    plan: StepPlan, stats: EngineStats, start_ns: int, end_ns: int, forward_ns: int
) -> StepEvent:
    """The ``step`` event of ``plan``; counts of running/waiting/KV from ``stats`` (after the
    step)."""
    return StepEvent(
        step=plan.step,
        start_ns=start_ns,
        end_ns=end_ns,
        token_budget=plan.token_budget,
        policy=plan.policy,
        num_decode_tokens=plan.num_decode_tokens,
        num_prefill_tokens=plan.num_prefill_tokens,
        num_scheduled_tokens=plan.num_scheduled_tokens,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_blocks_used=stats.kv_blocks_used,
        kv_blocks_total=stats.kv_blocks_total,
        num_preemptions=len(plan.preempted),
        chunks=[
            ChunkRecord(c.request_id, c.kind, c.start, c.num_tokens, c.produces_token, c.capped)
            for c in plan.chunks
        ],
        forward_ns=forward_ns,
        long_prefill_token_threshold=plan.long_prefill_token_threshold,
    )


def _wall(anchor: ClockAnchor, t_ns: int | None) -> float | None:
    return None if t_ns is None else anchor.to_wall(t_ns)


def request_output(
    req: Request,
    anchor: ClockAnchor,
    new: list[int],
    times_ns: list[int],
    error: str | None = None,
) -> RequestOutput:
    """A ``RequestOutput`` whose times are the wall-clock seconds of the engine's monotonic
    reads (``anchor.to_wall``), so they match the event stream exactly."""
    arrival = anchor.to_wall(req.arrival_ns)
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=new,
        token_times=[anchor.to_wall(t) for t in times_ns],
        finished=req.status.finished,
        finish_reason=req.finish_reason,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_image_tokens=req.num_image_tokens,
        num_cached_tokens=req.num_cached_tokens,
        traffic_class=req.traffic_class,
        arrival_time=arrival,
        first_scheduled_time=_wall(anchor, req.first_scheduled_ns),
        first_token_time=_wall(anchor, req.first_token_ns),
        error=error,
    )
