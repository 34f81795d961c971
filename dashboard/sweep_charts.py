"""The Sweep page's chart and table: pure functions from sweep / prediction documents to a Plotly
figure and a DataFrame (no Streamlit, no store), tested on fixed data.

A *document* is what ``python -m loadgen sweep --out`` writes (measured windows, with the
predicted figures side by side as ``predicted_*`` when the sweep had a prediction) or what
``python -m advisor predict --out`` writes (predicted windows only). Both have a ``windows`` list
of objects with ``budget``, ``itl_p99_ms``, ``ttft_p99_ms``, ``tokens_per_s``, and ``cap``
(``long_prefill_token_threshold``, 0 = off) when caps were swept: then a point is a
(budget, cap) pair, each cap drawn as its own line across the budgets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from advisor.pareto import front_pairs
from dashboard.charts import LAYOUT

MEASURED_COLOR = "#1f77b4"
PREDICTED_COLOR = "#ff7f0e"
SLO_COLOR = "#d62728"
RECOMMENDED_COLOR = "#2ca02c"
FIGURES = (
    "itl_p50_ms",
    "itl_p99_ms",
    "itl_p999_ms",
    "itl_max_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tokens_per_s",
)
OVERLOAD = "overloaded"  # advisor.overload.KEY: the window's verdict, shown beside its figures


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        return None
    return float(v)


def split_windows(
    doc: Mapping[str, Any] | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(measured, predicted) windows of a document: a sweep's windows are measured and carry
    their predictions as ``predicted_*``; a prediction document's windows are predicted."""
    if not doc:
        return [], []
    windows = [w for w in doc.get("windows") or [] if isinstance(w, Mapping) and "budget" in w]
    if str(doc.get("tool", "")).startswith("chunkscope-advisor"):
        return [], [dict(w) for w in windows]
    measured = [dict(w) for w in windows]
    predicted = [
        {
            "budget": w["budget"],
            **({"cap": w["cap"]} if "cap" in w else {}),
            **{k: w.get(f"predicted_{k}") for k in FIGURES},
            OVERLOAD: bool(w.get(f"predicted_{OVERLOAD}")),
            "overload_reason": w.get("predicted_overload_reason"),
        }
        for w in windows
        if any(f"predicted_{k}" in w for k in FIGURES)
    ]
    return measured, predicted


def _cap(w: Mapping[str, Any]) -> int | None:
    c = w.get("cap")
    return int(c) if isinstance(c, int | float) and not isinstance(c, bool) and c == c else None


def _pair(w: Mapping[str, Any]) -> tuple[int, int]:
    return int(w["budget"]), _cap(w) or 0


def point_label(w: Mapping[str, Any]) -> str:
    """``512``, or ``512/256`` for budget 512 with cap 256 (cap off: the budget alone)."""
    cap = _cap(w)
    return f"{int(w['budget'])}/{cap}" if cap else str(int(w["budget"]))


def _traces(
    windows: Sequence[Mapping[str, Any]], name: str, color: str, symbol: str
) -> list[go.Scatter]:
    """One trace per cap (just one when no cap was swept); the Pareto front over all pairs."""
    pts = [w for w in windows if _num(w.get("ttft_p99_ms")) is not None]
    pts = [w for w in pts if _num(w.get("itl_p99_ms")) is not None]
    front = {tuple(p) for p in front_pairs(pts)}
    caps = sorted({_cap(w) for w in pts}, key=lambda c: -1 if c is None else c)
    if caps == [None]:
        return [_trace(pts, front, name, color, symbol, None)]
    dashes = ("dot", "solid", "dash", "dashdot", "longdash")
    return [
        _trace(
            [w for w in pts if _cap(w) == c],
            front,
            f"{name}, cap {c or 'off'}",
            color,
            symbol if not c else f"{symbol}-open",
            dashes[i % len(dashes)],
        )
        for i, c in enumerate(caps)
    ]


def _trace(
    pts: Sequence[Mapping[str, Any]],
    front: set[tuple[int, ...]],
    name: str,
    color: str,
    symbol: str,
    dash: str | None,
) -> go.Scatter:
    pts = sorted(pts, key=lambda w: int(w["budget"]))
    return go.Scatter(
        x=[_num(w["ttft_p99_ms"]) for w in pts],
        y=[_num(w["itl_p99_ms"]) for w in pts],
        mode="markers+text+lines",
        line={"color": color, "width": 1, "dash": dash or "dot"},
        marker={
            "color": color,
            "size": [14 if _pair(w) in front else 9 for w in pts],
            "symbol": symbol,
            "line": {"width": 1, "color": color if symbol.endswith("-open") else "white"},
        },
        text=[point_label(w) for w in pts],
        textposition="top center",
        name=name,
        customdata=[[point_label(w), _num(w.get("tokens_per_s")), _pair(w) in front] for w in pts],
        hovertemplate=(
            f"{name}<br>budget/cap %{{customdata[0]}}<br>TTFT p99 %{{x:.0f}} ms<br>"
            "ITL p99 %{y:.1f} ms<br>%{customdata[1]:.1f} tokens/s<br>"
            "on the Pareto front: %{customdata[2]}<extra></extra>"
        ),
    )


def pareto_figure(
    measured: Sequence[Mapping[str, Any]],
    predicted: Sequence[Mapping[str, Any]],
    *,
    slo_itl_ms: float | None = None,
    slo_ttft_ms: float | None = None,
    recommended_budget: int | None = None,
    recommendation_source: str | None = None,
    recommended_cap: int | None = None,
) -> go.Figure:
    """TTFT p99 (x) against ITL p99 (y), one point per budget (or (budget, cap) pair, labelled
    ``budget/cap``), measured and predicted (points on each one's Pareto front drawn larger),
    the SLOs as lines, the recommendation ringed."""
    fig = go.Figure()
    fig.update_layout(
        **LAYOUT,
        title="Budgets: TTFT p99 against ITL p99 (lower left is better)",
        xaxis_title="TTFT p99 (ms)",
        yaxis_title="ITL p99 (ms)",
    )
    if not measured and not predicted:
        fig.add_annotation(
            text="No sweep or prediction yet", showarrow=False, x=0.5, y=0.5, xref="paper",
            yref="paper",
        )  # fmt: skip
        return fig
    for trace in _traces(measured, "measured", MEASURED_COLOR, "circle") if measured else []:
        fig.add_trace(trace)
    for trace in _traces(predicted, "predicted", PREDICTED_COLOR, "diamond") if predicted else []:
        fig.add_trace(trace)
    if slo_itl_ms is not None:
        fig.add_hline(
            y=slo_itl_ms, line={"color": SLO_COLOR, "dash": "dash"},
            annotation_text=f"ITL SLO {slo_itl_ms:g} ms", annotation_position="top right",
        )  # fmt: skip
    if slo_ttft_ms is not None:
        fig.add_vline(
            x=slo_ttft_ms, line={"color": SLO_COLOR, "dash": "dash"},
            annotation_text=f"TTFT SLO {slo_ttft_ms:g} ms", annotation_position="top right",
        )  # fmt: skip
    if recommended_budget is not None:
        source = measured if recommendation_source != "predicted" and measured else predicted
        point = next(
            (
                w
                for w in source
                if w.get("budget") == recommended_budget
                and (recommended_cap is None or (_cap(w) or 0) == recommended_cap)
            ),
            None,
        )
        x = _num(point.get("ttft_p99_ms")) if point else None
        y = _num(point.get("itl_p99_ms")) if point else None
        if x is not None and y is not None:
            fig.add_trace(
                go.Scatter(
                    x=[x],
                    y=[y],
                    mode="markers",
                    marker={
                        "size": 26,
                        "color": "rgba(0,0,0,0)",
                        "line": {"width": 3, "color": RECOMMENDED_COLOR},
                    },
                    name="recommended: "
                    + (
                        f"{recommended_budget}/{recommended_cap}"
                        if recommended_cap
                        else str(recommended_budget)
                    ),
                    hoverinfo="skip",
                )
            )
    return fig


def sweep_table(
    measured: Sequence[Mapping[str, Any]], predicted: Sequence[Mapping[str, Any]]
) -> pd.DataFrame:
    """One row per budget (per (budget, cap) pair when caps were swept): measured and predicted
    figures side by side."""
    every = [*measured, *predicted]
    with_caps = any(_cap(w) is not None for w in every)
    pairs = sorted({_pair(w) for w in every})
    m = {_pair(w): w for w in measured}
    p = {_pair(w): w for w in predicted}
    rows = []
    for b in pairs:
        row: dict[str, Any] = {"budget": b[0], **({"cap": b[1]} if with_caps else {})}
        for key in FIGURES:
            if measured:
                row[key] = _num(m.get(b, {}).get(key))
            if predicted:
                row[f"predicted {key}"] = _num(p.get(b, {}).get(key))
        if measured:
            row[OVERLOAD] = bool(m.get(b, {}).get(OVERLOAD))
        if predicted:
            row[f"predicted {OVERLOAD}"] = bool(p.get(b, {}).get(OVERLOAD))
        rows.append(row)
    return pd.DataFrame(rows)
