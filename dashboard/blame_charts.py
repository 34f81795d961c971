"""The blame ledger's figures and tables (``advisor.blame``): pure functions from its frames
and dicts to Plotly figures and display frames, no ``st.`` inside."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from dashboard.charts import DECODE_COLOR, LAYOUT, STALL_COLOR, _empty

OWN_COLOR = DECODE_COLOR
PAUSE_COLOR = "#c7c7c7"
MAX_LABELS = 12  # stalls labelled with their culprit on the timeline (the largest ones)


def stall_timeline_figure(gaps: pd.DataFrame) -> go.Figure:
    """One request's gaps, token by token (k = 1 is the time to its first token): each bar
    stacks its own work, the engine's pauses and the excess others caused; the largest stalls
    are labelled with the request that took most of their excess."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT, title="Who slowed it: each gap split", barmode="stack")
    if gaps is None or gaps.empty:
        return _empty(fig, "no gaps in the store for this request")
    culprit = gaps["culprit"].fillna("—").astype(str)
    custom = list(zip(culprit, gaps["culprit_ms"], gaps["gap_ms"], gaps["queue_ms"], strict=True))
    hover = (
        "token %{x}<br>%{fullData.name} %{y:.1f} ms<br>gap %{customdata[2]:.1f} ms"
        "<br>most of the excess: %{customdata[0]} (%{customdata[1]:.1f} ms)"
        "<br>queued %{customdata[3]:.1f} ms<extra></extra>"
    )
    for name, col, color in (
        ("own work", "own_ms", OWN_COLOR),
        ("pauses", "pause_ms", PAUSE_COLOR),
        ("excess (others)", "excess_ms", STALL_COLOR),
    ):
        fig.add_trace(
            go.Bar(
                name=name,
                x=gaps["k"],
                y=gaps[col],
                marker={"color": color},
                customdata=custom,
                hovertemplate=hover,
            )
        )
    stalls = gaps[gaps["stall"].astype(bool)].nlargest(MAX_LABELS, "excess_ms")
    if not stalls.empty:  # the tall ones: many short stalls side by side would pile up labels
        stalls = stalls[stalls["excess_ms"] >= 0.5 * stalls["excess_ms"].max()]
    for row in stalls.itertuples():
        fig.add_annotation(
            x=row.k,
            y=row.gap_ms,
            text=str(row.culprit),
            showarrow=True,
            arrowhead=0,
            ay=-24,
            font={"size": 10, "color": STALL_COLOR},
        )
    fig.update_xaxes(title_text="token k (1: first token)")
    fig.update_yaxes(title_text="ms")
    return fig


CULPRIT_COLUMNS = ["request_id", "traffic_class", "num_prompt_tokens", "ms", "queue_ms", "gaps"]
OFFENDER_COLUMNS = [
    "request_id",
    "traffic_class",
    "num_prompt_tokens",
    "cost_to_others_ms",
    "victims",
    "worst_victim_ms",
    "queue_ms",
]


def culprits_frame(culprits: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The culprits of one request as a table (largest first, as the ledger gives them)."""
    df = pd.DataFrame(list(culprits), columns=CULPRIT_COLUMNS)
    return df.round({"ms": 1, "queue_ms": 1})


def offenders_frame(offenders: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """The requests that cost the others most, as a table."""
    df = pd.DataFrame(list(offenders), columns=OFFENDER_COLUMNS)
    return df.round({"cost_to_others_ms": 1, "worst_victim_ms": 1, "queue_ms": 1})


def class_cost_figure(sides: dict[str, pd.DataFrame]) -> go.Figure:
    """Per window (``sides``: name -> ``Ledger.by_class`` frame), the excess each traffic
    class caused the other requests, in seconds, with its share."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT, title="Stall time caused, by traffic class", barmode="group")
    if not sides or all(df.empty for df in sides.values()):
        return _empty(fig, "no request slowed another in these windows")
    for name, df in sides.items():
        fig.add_trace(
            go.Bar(
                name=name,
                x=df["traffic_class"],
                y=df["ms"] / 1e3,
                customdata=df["share"] * 100,
                hovertemplate="%{x}: %{y:.2f} s (%{customdata:.0f}%)<extra>%{fullData.name}"
                "</extra>",
            )
        )
    fig.update_yaxes(title_text="s caused to other requests")
    return fig


def class_cost_line(by_class: pd.DataFrame) -> str:
    """``rag 81%, chat 19%``: each class's share of the excess, largest first."""
    if by_class is None or by_class.empty:
        return "nobody slowed anybody"
    return ", ".join(
        f"{cls} {100 * share:.0f}%"
        for cls, share in zip(by_class["traffic_class"], by_class["share"], strict=True)
    )


def replay_line(gain_ms: float | None, blamed_ms: float | None) -> str:
    """The simulator's counterfactual beside the ledger's blame, in one sentence."""
    if gain_ms is None:
        return "The replay has no figure for this request (it did not finish in both replays)."
    blamed = "—" if blamed_ms is None else f"{blamed_ms:.0f} ms"
    return (
        f"Replayed through the scheduler without it, this request would have finished "
        f"**{gain_ms:.0f} ms** sooner (predicted); the ledger blamed {blamed} on it."
    )
