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
        _num(s["throughput"]["output_tokens_per_s"], 1),
        _num(s["goodput"]["requests_per_s"], 2),
    ]


def table(summary: dict[str, Any]) -> str:
    """Fixed-width table: one row per class and one overall; times in ms."""
    head = " ".join(name.rjust(w) for name, w in _COLS)
    rows = [_row(c, s) for c, s in summary["classes"].items()]
    rows.append(_row("overall", summary["overall"]))
    lines = [head, "-" * len(head)]
    lines += [" ".join(v.rjust(w) for v, (_, w) in zip(r, _COLS, strict=True)) for r in rows]
    ov = summary["overall"]
    g = ov["goodput"]
    slos = (("TTFT", g["slo_ttft_ms"]), ("TPOT", g["slo_itl_ms"]))
    slo = ", ".join(f"{name} <= {v:g} ms" for name, v in slos if v is not None)
    lines.append(
        f"window {_num(ov['throughput']['window_s'], 2)} s; times in ms; good/s = requests/s "
        f"that succeeded{' with ' + slo if slo else ' (no SLO set)'}"
    )
    if ov["error_kinds"]:
        lines.append("errors: " + ", ".join(f"{k}: {v}" for k, v in ov["error_kinds"].items()))
    return "\n".join(lines)


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    try:
        text = json.dumps(result, separators=(",", ":"), allow_nan=False, default=_default)
    except ValueError:  # a server sent NaN/Infinity in its own block: keep it, non-strict
        logger.warning("result holds NaN/Infinity (from a server response); writing it anyway")
        text = json.dumps(result, separators=(",", ":"), default=_default)
    tmp.write_text(text)
    tmp.replace(p)
    logger.info("wrote %s", p)


def _default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, tuple | set):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
