"""Live scheduler changes: the one implementation behind ``PUT /v1/scheduler`` and the relay.

``apply_scheduler_update`` checks every key and value before anything is applied (a bad pair
changes nothing), applies the changes without blocking the caller's event loop, and reports
what was applied. It knows nothing of HTTP: the route maps ``ControlRefused`` to a 400, the
telemetry relay to a ``control_ack`` with ``ok: false``. It may be awaited on any event loop
(the server's, or the relay's own on another thread).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from engine.process.control import apply_changes
from engine.process.interface import ServedEngine, SteppedEngine
from wire.control import ControlRefused, check_changes
from wire.events import ControlEvent

logger = logging.getLogger(__name__)


@dataclass
class SchedulerChange:
    """What a change did: the step it applies at, the values before and after, its events."""

    applied_at_step: int | None
    old: dict[str, object] = field(default_factory=dict)
    new: dict[str, object] = field(default_factory=dict)
    events: list[ControlEvent] = field(default_factory=list)


async def apply_scheduler_update(
    engine: ServedEngine | SteppedEngine,
    changes: dict[str, object],
    *,
    source: str,
    request_id: str | None = None,
) -> SchedulerChange:
    """Check, then apply ``changes`` (any of ``wire.control.CONTROL_KEYS``) to ``engine``.

    ``engine`` is the server's ``EngineClient`` (the change is a round trip to the engine core,
    awaited without blocking the loop, with no timeout that could misreport an applied change)
    or an ``LLMEngine`` (its setters run on a worker thread). Raises ``ControlRefused`` when a
    key or value is bad or the engine refuses (nothing is applied then); the client raises its
    ``engine_dead`` error if the core is gone.
    """
    checked = check_changes(changes, int(engine.max_token_budget))
    if isinstance(engine, ServedEngine):
        events = await engine.control(checked, source=source, request_id=request_id)
    else:
        events = await asyncio.to_thread(apply_changes, engine, checked, source, request_id)
    refused = [e for e in events if not e.accepted]
    if refused:
        first = refused[0]
        raise ControlRefused(f"{first.key} change refused: {first.reason}", param=first.key)
    steps = [e.applied_at_step for e in events if e.applied_at_step is not None]
    change = SchedulerChange(
        applied_at_step=max(steps) if steps else None,
        old={e.key: e.old_value for e in events},
        new={e.key: e.new_value for e in events},
        events=events,
    )
    logger.info(
        "scheduler change from %s%s: %s -> %s at step %s",
        source,
        f" ({request_id})" if request_id else "",
        change.old,
        change.new,
        change.applied_at_step,
    )
    return change
