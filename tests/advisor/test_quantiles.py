"""A measured distribution kept as equal-mass quantiles: a uniform draw from them reproduces its
shares, and a one-in-thousands outlier is not drawn one time in ``k``."""

from __future__ import annotations

import numpy as np
import pytest

from advisor.fit import noise_model
from advisor.quantiles import mass_quantiles


def test_each_value_stands_for_an_equal_share() -> None:
    # 70% ones and 30% threes: 200 values keep 140 ones and 60 threes
    values = [1.0] * 700 + [3.0] * 300
    q = mass_quantiles(values, 200)
    assert len(q) == 200 and q == sorted(q)
    assert q.count(1.0) == 140 and q.count(3.0) == 60
    # fewer measurements than values: each is repeated as often as its share says
    assert mass_quantiles([2.0, 4.0], 4) == [2.0, 2.0, 4.0, 4.0]
    assert mass_quantiles([], 10) == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        mass_quantiles([1.0], 0)


def test_a_rare_pause_is_not_drawn_once_in_k() -> None:
    # 3,000 decode steps at their prediction and one 45x slower (the machine paused): kept as
    # 0, 1/199, ..., 1 quantiles the pause was one of 200 values and a simulated step drew it
    # once in 200 (15x too often); as equal shares, it falls in the top 1/400 and is left out
    pred = np.full(3001, 6e-3)
    measured = pred.copy()
    measured[1234] *= 45
    noise = noise_model(pred, measured, np.array([2e-4] * 2999 + [0.5]), binning="duration")
    assert max(max(r) for r in noise.ratios) == pytest.approx(1.0)
    assert max(noise.gaps_s) == pytest.approx(2e-4)
    # one pause in 100 steps is kept, at its share
    measured[::100] = pred[::100] * 45
    noise = noise_model(pred, measured, np.array([2e-4]), binning="duration")
    [ratios] = noise.ratios
    assert sum(r > 40 for r in ratios) == 2  # 31 of 3,001 steps: 2 of 200 values
