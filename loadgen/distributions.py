"""Seeded length distributions: lognormal fitted from a median and a p90, clipped.

A lognormal is pinned by two quantiles: mu = ln(median), sigma = ln(p90 / median) / z(0.9),
where z(0.9) = 1.2815515655446004 is the standard normal 90th percentile.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

Z90 = 1.2815515655446004


@dataclass(frozen=True)
class LogNormal:
    """Lognormal over token counts given by its median and p90, clipped to [lo, hi]."""

    median: float
    p90: float
    lo: int = 1
    hi: int = 1 << 20

    def __post_init__(self) -> None:
        if not (self.median > 0 and self.p90 >= self.median):
            raise ValueError(f"need 0 < median <= p90, got median={self.median} p90={self.p90}")
        if not (1 <= self.lo <= self.hi):
            raise ValueError(f"need 1 <= lo <= hi, got lo={self.lo} hi={self.hi}")

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / Z90

    def sample(
        self, rng: np.random.Generator, n: int | None = None, hi: int | None = None
    ) -> int | np.ndarray:
        """One draw (n is None) or n draws, rounded and clipped to [lo, min(hi, self.hi)]."""
        top = self.hi if hi is None else max(self.lo, min(self.hi, hi))
        x = rng.lognormal(self.mu, self.sigma, size=n)
        out = np.clip(np.rint(x), self.lo, top).astype(np.int64)
        return int(out) if n is None else out


def weighted_choice(rng: np.random.Generator, weights: dict[str, float]) -> str:
    """Pick a key with probability proportional to its weight (weights must sum > 0)."""
    keys = list(weights)
    w = np.asarray([max(0.0, float(weights[k])) for k in keys])
    total = w.sum()
    if total <= 0:
        raise ValueError(f"weights must have a positive sum: {weights}")
    return keys[int(rng.choice(len(keys), p=w / total))]
