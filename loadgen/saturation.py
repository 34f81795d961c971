"""Say when the offered load exceeds what the server served in the last minute.

The client knows when it sent each request and when each one finished: over the last
``window_s`` seconds (the run so far, when shorter), offered req/s is the sends, served req/s the
completions. A server that keeps up completes about as many as it is sent; one that does not
piles requests up (TTFTs of tens of seconds follow), and the run should say so while it goes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from advisor.overload import RATIO  # the windows' overload rule draws the same line

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
MIN_ELAPSED_S = 20.0  # the first requests have not had time to finish before this


@dataclass(frozen=True)
class Load:
    offered_rps: float
    served_rps: float
    window_s: float
    in_flight: int

    @property
    def overloaded(self) -> bool:
        return self.offered_rps > RATIO * self.served_rps and self.in_flight > 0

    def describe(self) -> str:
        return (
            f"offered {self.offered_rps:.2f} req/s but the server completed "
            f"{self.served_rps:.2f} req/s over the last {self.window_s:.0f} s "
            f"({self.in_flight} in flight): it cannot keep up, so queueing will dominate "
            "every latency; lower --rate or --chat-background"
        )


def load(
    sent: Sequence[float], done: Sequence[float], now: float, *, window_s: float = WINDOW_S
) -> Load | None:
    """Offered and served req/s over the last ``window_s`` seconds of a run that started at 0
    (``sent``/``done``: seconds since the start); None while the run is too young to tell."""
    if now < MIN_ELAPSED_S:
        return None
    w = min(window_s, now)
    lo = now - w
    n_sent = sum(1 for t in sent if t >= lo)
    n_done = sum(1 for t in done if t >= lo)
    return Load(n_sent / w, n_done / w, w, len(sent) - len(done))
