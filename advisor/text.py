"""What `python -m advisor predict` and `python -m loadgen sweep` share on the command line: the
`--budgets` and `--caps` lists and the per-(budget, cap) table. Plain Python."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_BUDGETS = "128,256,512,1024,2048,8192"
DEFAULT_CAPS = "0"
WINDOW_COLUMNS = (
    "budget",
    "cap",
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "itl_max_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokens_per_s",
    "overloaded",
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


def parse_caps(text: str) -> list[int]:
    """``"0,256"`` -> ``[0, 256]``: long-prefill caps (``long_prefill_token_threshold``; 0 = off)
    to try beside each budget (an argparse type: bad input is a usage error)."""
    try:
        caps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"caps must be integers, got {text!r}") from exc
    if not caps or any(c < 0 for c in caps):
        raise argparse.ArgumentTypeError(f"caps must be >= 0 (0: no cap), got {text!r}")
    return list(dict.fromkeys(caps))


def pairs_of(budgets: Sequence[int], caps: Sequence[int]) -> list[tuple[int, int]]:
    """Every (budget, cap) to try, by budget then cap; a cap at or above its budget cuts nothing
    (it equals cap 0), so it is left out unless it is the only one."""
    out = []
    for b in sorted({int(x) for x in budgets}):
        useful = [c for c in dict.fromkeys(int(x) for x in caps) if c == 0 or c < b]
        for c in sorted(useful or [0]):
            out.append((b, c))
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def _cell(window: Mapping[str, Any], column: str) -> str:
    """A figure, with the lowest and highest of its draws where there were several
    (``advisor.predict.median_windows``' ``draw_range``)."""
    text = _fmt(window.get(column))
    lo_hi = (window.get("draw_range") or {}).get(column)
    if lo_hi and window.get(column) is not None and lo_hi[0] != lo_hi[1]:
        text += f" ({lo_hi[0]:.0f}-{lo_hi[1]:.0f})"
    return text


def budget_table(
    windows: Sequence[Mapping[str, Any]], columns: Sequence[str], pareto: Sequence[int]
) -> list[str]:
    """One right-aligned line per budget under a header, then the Pareto front."""
    rows = [[_cell(w, c) for c in columns] for w in windows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(wd) for c, wd in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(wd) for v, wd in zip(r, widths, strict=True)) for r in rows]
    lines.append(f"Pareto front (TTFT p99 vs ITL p99): {list(pareto)}")
    return lines
