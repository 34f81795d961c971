"""A measured distribution kept as a fixed number of values that a uniform draw samples from.

Each of the ``k`` values stands for an equal share ``1/k`` of the measurements: the quantile at
the middle of its share, ``(i + 0.5) / k``. The rarest measurements (the top and bottom
``1/(2k)``) are then left out, as a sample of that size would mostly leave them out. Kept at
``0, 1/(k-1), ..., 1`` instead, the minimum and the maximum each stand for ``1/k``: a step that
was 45x slower once in about 2,500 (a pause of the machine) was drawn once in 200, and the
simulated chat ITL p99 of the demo engine came out 2.3x the measured one (issue 19).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mass_quantiles(values: Sequence[float] | np.ndarray, k: int) -> list[float]:
    """``k`` values of ``values``' distribution, each the middle of an equal share of it
    (``[]`` for no values)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return []
    qs = (np.arange(k) + 0.5) / k
    return [float(v) for v in np.quantile(a, qs, method="inverted_cdf")]
