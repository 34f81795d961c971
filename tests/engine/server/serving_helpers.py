"""Helpers shared by the server tests (in-thread and process mode)."""

from __future__ import annotations

from wire.events import StepEvent


class StepLog:
    def __init__(self) -> None:
        self.steps: list[StepEvent] = []

    def __call__(self, event: object) -> None:
        if isinstance(event, StepEvent):
            self.steps.append(event)
