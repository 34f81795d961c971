"""Arrival processes: mean rate and coefficient of variation; ramps; camera streams."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.arrivals import ArrivalSpec, arrival_times, camera_times


def _gaps(spec: ArrivalSpec, n: int = 40_000) -> np.ndarray:
    t = arrival_times(spec, np.random.default_rng(11), num=n)
    assert len(t) == n and np.all(np.diff(t) >= 0)
    return np.diff(t)


@pytest.mark.parametrize(
    ("kind", "shape", "cv"),
    [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0)],
)
def test_rate_and_cv(kind: str, shape: float, cv: float) -> None:
    g = _gaps(ArrivalSpec(kind, rate=20.0, burstiness=shape))
    assert 1.0 / g.mean() == pytest.approx(20.0, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(cv, abs=0.06)


def test_duration_bound_and_count() -> None:
    rng = np.random.default_rng(0)
    t = arrival_times(ArrivalSpec("poisson", rate=50.0), rng, duration=20.0)
    assert t.max() < 20.0 and len(t) == pytest.approx(1000, rel=0.1)
    t = arrival_times(ArrivalSpec("poisson", rate=50.0), rng, duration=20.0, num=10)
    assert len(t) == 10


def test_linear_ramp() -> None:
    spec = ArrivalSpec("constant", rate=100.0, ramp_s=10.0, ramp_from=0.0)
    t = arrival_times(spec, np.random.default_rng(0), duration=20.0)
    # Lambda(10) = 500 arrivals during the ramp, then 100/s for 10 s
    assert np.sum(t < 10.0) == pytest.approx(500, abs=2)
    assert np.sum(t >= 10.0) == pytest.approx(1000, abs=2)
    first, second = np.sum(t < 5.0), np.sum((t >= 5.0) & (t < 10.0))
    assert first == pytest.approx(125, abs=2) and second == pytest.approx(375, abs=2)


def test_bad_specs() -> None:
    for kw in ({"kind": "uniform"}, {"rate": 0.0}, {"burstiness": 0.0}, {"ramp_s": -1.0}):
        with pytest.raises(ValueError):
            ArrivalSpec(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        arrival_times(ArrivalSpec(), np.random.default_rng(0))


def test_camera_streams() -> None:
    t, sid = camera_times(4, 2.0, 0.02, np.random.default_rng(1), duration=10.0)
    assert np.all(np.diff(t) >= 0) and set(sid.tolist()) == {0, 1, 2, 3}
    for s in range(4):
        gaps = np.diff(t[sid == s])
        assert np.all(np.abs(gaps - 0.5) <= 0.041)
        assert len(gaps) + 1 == pytest.approx(20, abs=1)
    t2, _ = camera_times(3, 10.0, 0.0, np.random.default_rng(1), num=25)
    assert len(t2) == 25
