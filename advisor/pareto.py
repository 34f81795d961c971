"""The Pareto front of budgets on (TTFT p99, ITL p99): the budgets no other budget beats on
both. A small budget spreads prompts over many short steps (low ITL, high TTFT); a large one
prefills in few long steps (low TTFT, high ITL). Plain Python."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

X_KEY = "ttft_p99_ms"
Y_KEY = "itl_p99_ms"


def _xy(w: Mapping[str, Any]) -> tuple[float, float] | None:
    x, y = w.get(X_KEY), w.get(Y_KEY)
    if not isinstance(x, int | float) or not isinstance(y, int | float):
        return None
    return float(x), float(y)


def dominates(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """``a`` is no worse than ``b`` on both figures and better on one."""
    pa, pb = _xy(a), _xy(b)
    if pa is None or pb is None:
        return False
    return pa[0] <= pb[0] and pa[1] <= pb[1] and pa != pb


def pareto_front(windows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The non-dominated windows (those with both figures), by increasing TTFT p99. Windows with
    identical figures are all kept."""
    pts = [w for w in windows if _xy(w) is not None]
    front = [w for w in pts if not any(dominates(o, w) for o in pts if o is not w)]
    return sorted(front, key=lambda w: (_xy(w), w.get("budget", 0)))  # type: ignore[arg-type,return-value]


def front_budgets(windows: Sequence[Mapping[str, Any]]) -> list[int]:
    return [int(w["budget"]) for w in pareto_front(windows) if "budget" in w]


def front_pairs(windows: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    """The front as ``[budget, cap]`` pairs (cap 0 when a window has none)."""
    return [
        [int(w["budget"]), int(w.get("cap") or 0)] for w in pareto_front(windows) if "budget" in w
    ]
