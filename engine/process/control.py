"""Applying checked scheduler changes to an engine on the thread that owns it (the engine core,
or an embedder without one). The checks are ``wire.control``'s; the async, HTTP-facing wrapper is
``engine.server.control.apply_scheduler_update``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from engine.process.interface import SteppedEngine
from wire.control import CAP_KEY, check_changes
from wire.events import ControlEvent


def apply_changes(
    engine: SteppedEngine, changes: Mapping[str, object], source: str, request_id: str | None
) -> list[ControlEvent]:
    """Apply checked changes to an ``LLMEngine`` (on the thread that owns the call): its
    ``ControlEvent`` per key. Used by the engine core and by embedders without a core."""
    checked = check_changes(changes, int(engine.max_token_budget))
    setters: dict[str, Callable[..., ControlEvent]] = {
        "token_budget": engine.set_token_budget,
        "policy": engine.set_policy,
        CAP_KEY: engine.set_long_prefill_token_threshold,
    }
    events = []
    for key, value in checked.items():
        setter = setters[key]
        kwargs: dict[str, object] = {"source": source}
        if request_id is not None and takes_keyword(setter, "request_id"):
            kwargs["request_id"] = request_id
        events.append(setter(value, **kwargs))
    return events


def takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (engines older or newer than this server)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
