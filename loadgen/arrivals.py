"""Arrival processes: Poisson, gamma (burstiness = shape, 1 = Poisson), constant; linear ramp.

Each process is a renewal process in *operational time* with unit mean gap; a rate function r(t)
maps it to wall time through Lambda(t) = integral of r (time-rescaling). A linear ramp from
`ramp_from` to `rate` over `ramp_s` seconds, then flat at `rate`, inverts in closed form.
Gamma gaps with shape k have coefficient of variation 1 / sqrt(k).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

ARRIVALS = ("poisson", "gamma", "constant")
MAX_ARRIVALS = 1_000_000  # hard bound on any generated schedule


@dataclass(frozen=True)
class ArrivalSpec:
    """One class's arrival process. rate in req/s; burstiness is the gamma shape."""

    kind: str = "poisson"
    rate: float = 1.0
    burstiness: float = 1.0
    ramp_s: float = 0.0
    ramp_from: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.kind!r}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness (gamma shape) must be > 0, got {self.burstiness}")
        if self.ramp_s < 0 or self.ramp_from < 0:
            raise ValueError("ramp seconds and ramp start rate must be >= 0")


def _unit_gaps(spec: ArrivalSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    if spec.kind == "constant":
        return np.ones(n)
    if spec.kind == "poisson":
        return rng.exponential(1.0, size=n)
    return rng.gamma(spec.burstiness, 1.0 / spec.burstiness, size=n)


def _to_wall(spec: ArrivalSpec, big_lambda: np.ndarray) -> np.ndarray:
    """Invert Lambda(t) for the (optionally ramped) rate."""
    r1, r0, ramp = spec.rate, spec.ramp_from, spec.ramp_s
    if ramp <= 0 or r0 == r1:
        return big_lambda / r1
    lam_ramp = (r0 + r1) * ramp / 2.0  # operational time used by the ramp
    a = (r1 - r0) / (2.0 * ramp)  # Lambda(t) = r0 t + a t^2 on [0, ramp]
    out = np.empty_like(big_lambda)
    inside = big_lambda <= lam_ramp
    lam = big_lambda[inside]
    if a != 0:
        out[inside] = (-r0 + np.sqrt(r0 * r0 + 4.0 * a * lam)) / (2.0 * a)
    else:
        out[inside] = lam / r0
    out[~inside] = ramp + (big_lambda[~inside] - lam_ramp) / r1
    return out


def arrival_times(
    spec: ArrivalSpec,
    rng: np.random.Generator,
    *,
    num: int | None = None,
    duration: float | None = None,
) -> np.ndarray:
    """Send offsets (s from start, ascending) bounded by `num` arrivals and/or `duration` s.

    The first arrival is at one gap after 0 (not at 0) so class streams in a mix stay independent.
    """
    if num is None and duration is None:
        raise ValueError("need num and/or duration")
    cap = MAX_ARRIVALS if num is None else min(num, MAX_ARRIVALS)
    times: list[np.ndarray] = []
    lam0, have, block = 0.0, 0, 1024
    for _ in range(MAX_ARRIVALS // 1024 + 2):  # bounded: blocks grow, cap stops it
        n = min(block, cap - have)
        if n <= 0:
            break
        lam = lam0 + np.cumsum(_unit_gaps(spec, rng, n))
        lam0 = float(lam[-1])
        t = _to_wall(spec, lam)
        if duration is not None:
            keep = t < duration
            times.append(t[keep])
            have += int(keep.sum())
            if not keep.all():
                break
        else:
            times.append(t)
            have += n
        block = min(block * 2, 65536)
    return np.concatenate(times) if times else np.zeros(0)


def camera_times(
    streams: int,
    fps: float,
    jitter_s: float,
    rng: np.random.Generator,
    *,
    num: int | None = None,
    duration: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """N camera streams, each one frame every 1/fps s (random phase) plus uniform +-jitter.

    Returns (send offsets ascending, stream index of each).
    """
    if streams <= 0 or not fps > 0 or jitter_s < 0:
        raise ValueError("camera mode needs streams >= 1, fps > 0, jitter >= 0")
    if num is None and duration is None:
        raise ValueError("need num and/or duration")
    period = 1.0 / fps
    if duration is None:
        frames = math.ceil((num or 0) / streams) + 1
    else:
        frames = math.ceil(duration * fps) + 1
    frames = min(frames, MAX_ARRIVALS // streams + 1)
    phase = rng.uniform(0.0, period, size=(streams, 1))
    k = np.arange(frames)[None, :]
    t = phase + k * period + rng.uniform(-jitter_s, jitter_s, size=(streams, frames))
    t = np.maximum(t, 0.0)
    sid = np.broadcast_to(np.arange(streams)[:, None], t.shape)
    t, sid = t.ravel(), sid.ravel()
    order = np.argsort(t, kind="stable")
    t, sid = t[order], sid[order]
    if duration is not None:
        keep = t < duration
        t, sid = t[keep], sid[keep]
    if num is not None:
        t, sid = t[:num], sid[:num]
    return t, sid.copy()
