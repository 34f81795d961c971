"""What `python -m advisor predict` and `python -m loadgen sweep` share on the command line: the
`--budgets` list and the per-budget table. Plain Python."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_BUDGETS = "128,256,512,1024,2048,8192"
WINDOW_COLUMNS = (
    "budget",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_max_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokens_per_s",
)


def parse_budgets(text: str) -> list[int]:
    """``"128,256,512"`` -> ``[128, 256, 512]`` (an argparse type: bad input is a usage error)."""
    try:
        budgets = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"budgets must be integers, got {text!r}") from exc
    if not budgets or any(b < 1 for b in budgets):
        raise argparse.ArgumentTypeError(f"budgets must be >= 1, got {text!r}")
    return budgets


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def budget_table(
    windows: Sequence[Mapping[str, Any]], columns: Sequence[str], pareto: Sequence[int]
) -> list[str]:
    """One right-aligned line per budget under a header, then the Pareto front."""
    rows = [[_fmt(w.get(c)) for c in columns] for w in windows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(wd) for c, wd in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(wd) for v, wd in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"Pareto front (TTFT p99 vs ITL p99): {list(pareto)}")
    return lines
