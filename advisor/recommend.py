"""Which token budget (and long-prefill cap) to run: the highest-throughput one that meets the
latency SLOs.

Plain Python (no numpy, no engine): the load generator's sweep uses it on its measurements and
the advisor on its predictions.

Rule: a budget meets the SLOs when its p99 ITL is at most ``slo_itl_ms``, (when given) its p99
TTFT at most ``slo_ttft_ms`` and its stall tail (ITL max, ITL p99.9: ``Slo.itl_max_ms``,
``Slo.itl_p999_ms``) within its own SLO; a figure that was not observed does not meet an SLO. A
window judged overloaded (``advisor.overload``: its queue grew through it, or requests failed)
is never recommended, nor named as the closest. Among the rest, the one with the highest
throughput; throughputs within ``tie_tolerance`` (relative) of the best are a tie - below
saturation every budget serves the offered load, so throughput differs only by noise - broken in
favour of the lower stall tail (ITL max, then ITL p99.9, then ITL p99, each within
``TAIL_TOLERANCE``: a p99 SLO cannot see a stall of one step in a thousand), then the lower TTFT
p99, then the largest budget. A window with a
``cap`` (``long_prefill_token_threshold``, 0 = off) makes the recommendation a (budget, cap)
pair. Without any SLO every budget qualifies. When none meets them, there is no
recommendation; the closest budget is named (least total relative excess over the SLOs).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from advisor import overload

logger = logging.getLogger(__name__)

SOURCES = ("measured", "predicted")
TIE_TOLERANCE = 0.02


@dataclass(frozen=True)
class Slo:
    itl_ms: float | None = None  # on the p99 inter-token latency
    ttft_ms: float | None = None  # on the p99 time to first token
    itl_max_ms: float | None = None  # on the longest inter-token gap (a stall)
    itl_p999_ms: float | None = None  # on the p99.9 inter-token latency

    @property
    def empty(self) -> bool:
        return all(limit is None for _, limit, _ in self.limits())

    def limits(self) -> list[tuple[str, float | None, str]]:
        """(window key, limit, label) of every SLO, set or not."""
        return [
            ("itl_p99_ms", self.itl_ms, "ITL p99"),
            ("ttft_p99_ms", self.ttft_ms, "TTFT p99"),
            ("itl_max_ms", self.itl_max_ms, "ITL max"),
            ("itl_p999_ms", self.itl_p999_ms, "ITL p99.9"),
        ]

    def to_dict(self) -> dict[str, float | None]:
        """The SLO block of a sweep or prediction document (``itl_p99_ms``, ...)."""
        return {key: limit for key, limit, _ in self.limits()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Slo:
        d = d or {}

        def f(key: str) -> float | None:
            v = d.get(key)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

        return cls(f("itl_p99_ms"), f("ttft_p99_ms"), f("itl_max_ms"), f("itl_p999_ms"))


@dataclass(frozen=True)
class Recommendation:
    budget: int | None  # None when no budget meets the SLOs
    source: str  # "measured" | "predicted"
    meets_slo: bool
    closest_budget: int | None  # the budget nearest to the SLOs when none meets them
    reason: str
    cap: int | None = None  # the long-prefill cap paired with ``budget`` (None: not swept)
    closest_cap: int | None = None

    @property
    def chosen(self) -> int | None:
        """The budget to apply: the recommendation, else the closest."""
        return self.budget if self.budget is not None else self.closest_budget

    @property
    def chosen_cap(self) -> int | None:
        """The cap to apply with :attr:`chosen` (None when caps were not swept)."""
        return self.cap if self.budget is not None else self.closest_cap

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cap(w: Mapping[str, Any]) -> int | None:
    c = w.get("cap")
    return int(c) if isinstance(c, int) and not isinstance(c, bool) else None


def label(w: Mapping[str, Any]) -> str:
    """``budget 512`` or ``budget 512 with cap 256`` (``cap off`` for 0)."""
    cap = _cap(w)
    if cap is None:
        return f"budget {w['budget']}"
    return f"budget {w['budget']} with cap {cap or 'off'}"


def _num(w: Mapping[str, Any], key: str) -> float | None:
    v = w.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def excess(w: Mapping[str, Any], slo: Slo) -> float:
    """Sum over the SLOs of the relative amount by which the window misses it (0 = meets all;
    an unobserved figure counts as missing by 1, i.e. twice the SLO)."""
    total = 0.0
    for key, limit, _ in slo.limits():
        if limit is None:
            continue
        v = _num(w, key)
        total += 1.0 if v is None else max(0.0, v / limit - 1.0)
    return total


def meets(w: Mapping[str, Any], slo: Slo) -> bool:
    for key, limit, _ in slo.limits():
        if limit is None:
            continue
        v = _num(w, key)
        if v is None or v > limit:
            return False
    return True


def _describe(w: Mapping[str, Any]) -> str:
    parts = []
    for key, name in (
        ("itl_p99_ms", "ITL p99"),
        ("itl_max_ms", "ITL max"),
        ("ttft_p99_ms", "TTFT p99"),
    ):
        v = _num(w, key)
        parts.append(f"{name} {'n/a' if v is None else f'{v:.0f} ms'}")
    tps = _num(w, "tokens_per_s")
    parts.append(f"{'n/a' if tps is None else f'{tps:.1f}'} tokens/s")
    return ", ".join(parts)


def _slo_text(slo: Slo) -> str:
    parts = [f"{name} <= {limit:g} ms" for _, limit, name in slo.limits() if limit is not None]
    return " and ".join(parts) if parts else "no SLO"


def recommend(
    windows: Sequence[Mapping[str, Any]],
    slo: Slo,
    source: str,
    *,
    tie_tolerance: float = TIE_TOLERANCE,
) -> Recommendation:
    """The recommendation among ``windows`` (dicts with ``budget``, ``itl_p99_ms``,
    ``ttft_p99_ms``, ``tokens_per_s``) from ``source`` ("measured" or "predicted")."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    rows = [w for w in windows if isinstance(w.get("budget"), int)]
    if not rows:
        return Recommendation(None, source, False, None, f"no {source} budgets to choose from")
    overload_note = overload.describe(rows)
    usable = [w for w in rows if not overload.is_overloaded(w)]
    if not usable:
        return Recommendation(
            None, source, False, None, f"{source}: no recommendation, every window {overload_note}"
        )
    after = f" ({overload_note})" if overload_note else ""
    ok = [w for w in usable if meets(w, slo)]
    if ok:
        best = max(_num(w, "tokens_per_s") or 0.0 for w in ok)
        tied = [w for w in ok if (_num(w, "tokens_per_s") or 0.0) >= best * (1 - tie_tolerance)]
        pick = break_tie(tied)
        budgets = sorted(
            {label(w).removeprefix("budget ") for w in ok}, key=lambda t: int(t.split()[0])
        )
        tie_note = (
            f"; {len(tied)} budgets within {tie_tolerance:.0%} of the best throughput, the one "
            "with the lowest stall tail (ITL max) taken"
            if len(tied) > 1
            else ""
        )
        reason = (
            f"{source}: {label(pick)} has the highest throughput among the budgets "
            f"meeting {_slo_text(slo)} ({', '.join(budgets)}){tie_note}: "
            f"{_describe(pick)}{after}"
        )
        return Recommendation(int(pick["budget"]), source, True, None, reason, cap=_cap(pick))
    closest = min(usable, key=lambda w: (excess(w, slo), -(_num(w, "tokens_per_s") or 0.0)))
    reason = (
        f"{source}: no budget meets {_slo_text(slo)}; closest is {label(closest)} "
        f"({_describe(closest)}){after}"
    )
    return Recommendation(
        None, source, False, int(closest["budget"]), reason, closest_cap=_cap(closest)
    )


TAIL_KEYS = ("itl_max_ms", "itl_p999_ms", "itl_p99_ms", "ttft_p99_ms")
TAIL_TOLERANCE = 0.10  # tails within 10% of the lowest are equal (one sample decides a max)


def break_tie(tied: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """Among windows tied on throughput: those with the lowest ITL max (within
    ``TAIL_TOLERANCE``), among them the lowest ITL p99.9, then ITL p99, then TTFT p99 (an
    unobserved figure decides nothing), then the largest budget."""
    left = list(tied)
    for key in TAIL_KEYS:
        vals = [_num(w, key) for w in left]
        seen = [v for v in vals if v is not None]
        if not seen:
            continue
        top = min(seen) * (1 + TAIL_TOLERANCE)
        left = [w for w, v in zip(left, vals, strict=True) if v is not None and v <= top]
    return max(left, key=lambda w: int(w["budget"]))


def recommend_from(
    measured: Sequence[Mapping[str, Any]] | None,
    predicted: Sequence[Mapping[str, Any]] | None,
    slo: Slo,
) -> Recommendation:
    """From the measurements when a sweep exists, otherwise from the prediction."""
    if measured:
        return recommend(measured, slo, "measured")
    return recommend(predicted or [], slo, "predicted")
