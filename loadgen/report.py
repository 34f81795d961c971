"""The end-of-run summary table and the result JSON file."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_COLS = (
    ("class", 8),
    ("n", 6),
    ("ok", 6),
    ("err", 5),
    ("TTFT p50", 9),
    ("p90", 8),
    ("p99", 8),
    ("ITL p50", 8),
    ("p99", 8),
    ("TPOT p50", 9),
    ("E2E p50", 9),
    ("p99", 9),
    ("out tok/s", 10),
    ("good/s", 8),
)


def _ms(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _num(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _row(name: str, s: dict[str, Any]) -> list[str]:
    t, i, p, e = s["ttft_ms"], s["itl_ms"], s["tpot_ms"], s["e2e_ms"]
    return [
        name,
        str(s["requests"]),
        str(s["ok"]),
        str(s["errors"]),
        _ms(t["p50"]),
        _ms(t["p90"]),
        _ms(t["p99"]),
        _ms(i["p50"]),
        _ms(i["p99"]),
        _ms(p["p50"]),
        _ms(e["p50"]),
        _ms(e["p99"]),
        f"{s['throughput']['output_tokens_per_s']:.1f}",
        f"{s['goodput']['requests_per_s']:.2f}",
    ]


def table(summary: dict[str, Any]) -> str:
    """Fixed-width table: one row per class and one overall; times in ms."""
    head = " ".join(name.rjust(w) for name, w in _COLS)
    rows = [_row(c, s) for c, s in summary["classes"].items()]
    rows.append(_row("overall", summary["overall"]))
    lines = [head, "-" * len(head)]
    lines += [" ".join(v.rjust(w) for v, (_, w) in zip(r, _COLS, strict=True)) for r in rows]
    ov = summary["overall"]
    lines.append(
        f"window {ov['throughput']['window_s']:.2f} s; times in ms; "
        f"goodput = requests/s meeting the SLOs ({ov['goodput']['slo_ttft_ms']} ms TTFT, "
        f"{ov['goodput']['slo_itl_ms']} ms TPOT)"
    )
    if ov["error_kinds"]:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in ov["error_kinds"].items()))
    return "\n".join(lines)


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False, default=_default))
    tmp.replace(p)
    logger.info("wrote %s", p)


def _default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, tuple | set):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
