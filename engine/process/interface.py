"""What the layers above need of an engine, as types (in place of ``Any`` and ``getattr``).

:class:`SteppedEngine` is an engine driven on its own thread (``LLMEngine``): the engine core
and embedders without a core apply changes through its setters. :class:`ServedEngine` is the
server's handle on an engine core (``EngineClient``): what the HTTP control route and the
telemetry hook read and call. Both are structural (``typing.Protocol``); nothing subclasses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from engine.core.config import EngineConfig
from engine.core.outputs import EngineStats
from wire.events import ClockAnchor, ControlEvent, Event


class SteppedEngine(Protocol):
    """An engine whose live controls are plain setters (``LLMEngine``)."""

    @property
    def max_token_budget(self) -> int: ...

    def set_token_budget(
        self, value: object, source: str = ..., request_id: str | None = ...
    ) -> ControlEvent: ...

    def set_policy(
        self, value: object, source: str = ..., request_id: str | None = ...
    ) -> ControlEvent: ...

    def set_long_prefill_token_threshold(
        self, value: object, source: str = ..., request_id: str | None = ...
    ) -> ControlEvent: ...


@runtime_checkable
class ServedEngine(Protocol):
    """The server's handle on an engine core (``EngineClient``)."""

    config: EngineConfig
    pid: int
    max_token_budget: int
    max_model_len: int
    clock_anchor: ClockAnchor | None

    @property
    def mode(self) -> str: ...

    @property
    def token_budget(self) -> int: ...

    @property
    def policy(self) -> str: ...

    def stats(self) -> EngineStats: ...

    def add_listener(self, fn: Callable[[Event], None]) -> None: ...

    async def control(
        self, changes: dict[str, object], *, source: str, request_id: str | None = None
    ) -> list[ControlEvent]: ...
