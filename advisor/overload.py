"""When a window is overloaded: the one rule the sweep, the advisor and the dashboard share.

A window is overloaded when its requests fail or time out, or when its queue grows through it:
the requests queued (arrived, no first token yet) at its end outnumber those at its start by more
than ``GROWTH_SHARE`` of the requests that arrived in it (and by at least ``MIN_GROWTH``). The
queue is what waits for its first token, not what is in flight: a request decoding its answer
is being served, and a window's last arrivals are always in flight at its end. Below
saturation every request that arrives is served and the queue returns to where it was; above it
the queue, and every latency with it, grows for as long as the window lasts, so the window's
figures describe how long it was measured rather than the setting. Such a window is reported as
overloaded and is never turned into a recommendation (``advisor.recommend``).

``GROWTH_SHARE`` is ``1 - 1 / RATIO``: the window served fewer than ``1 / RATIO`` of the
requests it was offered, the same line as ``loadgen.saturation``'s offered > 1.25 x served.

Plain Python: measured windows (the client's records), simulated ones (``advisor.simulate``) and
stored ones (the engine's requests) each count their four numbers and call :func:`judge`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RATIO = 1.25  # offered above served by more than this is overload, not noise
GROWTH_SHARE = 1.0 - 1.0 / RATIO
MIN_GROWTH = 4  # requests: a few long prompts arriving at the end of a window are not overload
KEY = "overloaded"
REASON_KEY = "overload_reason"


@dataclass(frozen=True)
class WindowLoad:
    """What the rule looks at in one window."""

    arrived: int  # requests that arrived (were sent) in the window
    queued_start: int  # queued at the window's start: arrived, no first token yet
    queued_end: int  # queued at the window's end
    failed: int = 0  # requests of the window that failed or timed out

    @property
    def growth(self) -> int:
        return self.queued_end - self.queued_start

    @property
    def overloaded(self) -> bool:
        return self.failed > 0 or queue_grows(self.arrived, self.growth)

    def reason(self) -> str | None:
        """Why the window is overloaded (None when it is not)."""
        parts = []
        if self.failed > 0:
            parts.append(f"{self.failed} of its {self.arrived} requests failed or timed out")
        if queue_grows(self.arrived, self.growth):
            parts.append(
                f"its queue grew from {self.queued_start} to {self.queued_end} requests "
                f"waiting for a first token while {self.arrived} arrived"
            )
        return "; ".join(parts) or None

    def to_dict(self) -> dict[str, Any]:
        """The keys a window dict carries: the verdict, its reason, the queue at both ends."""
        return {
            KEY: self.overloaded,
            REASON_KEY: self.reason(),
            "queued_start": self.queued_start,
            "queued_end": self.queued_end,
        }


def queue_grows(arrived: int, growth: int) -> bool:
    """The rule's second half: the queue grew by more than the window can explain by chance."""
    # growth > GROWTH_SHARE * arrived, multiplied out (1 - 1/1.25 is not exact in binary)
    return growth >= MIN_GROWTH and growth * RATIO > (RATIO - 1.0) * max(arrived, 0)


def judge(
    arrivals: Iterable[float],
    first_tokens: Iterable[float | None],
    lo: float,
    hi: float,
    *,
    failed: int = 0,
) -> WindowLoad:
    """The load of the window [lo, hi) from each request's arrival and first token (same clock,
    same order; None: none ever came)."""
    arrived = start = end = 0
    for a, f in zip(arrivals, first_tokens, strict=True):
        if lo <= a < hi:
            arrived += 1
        if a < lo and (f is None or f > lo):
            start += 1
        if a < hi and (f is None or f > hi):
            end += 1
    return WindowLoad(arrived, start, end, failed)


def is_overloaded(window: Mapping[str, Any]) -> bool:
    """Whether a window dict (sweep, prediction) was judged overloaded."""
    return bool(window.get(KEY))


def describe(windows: Iterable[Mapping[str, Any]]) -> str | None:
    """One line naming the overloaded windows and why, or None."""
    from advisor.recommend import label

    bad = [w for w in windows if is_overloaded(w)]
    if not bad:
        return None
    return "overloaded (not recommended): " + "; ".join(
        f"{label(w)}: {w.get(REASON_KEY) or 'queue growing'}" for w in bad
    )
