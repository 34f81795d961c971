"""Charts: pure functions from DataFrames (shaped like ``storage.queries``) to Plotly figures.

Nothing here touches Streamlit or the database, so every chart is tested on fixed frames. Times
in the frames are wall-clock seconds since the epoch; the figures show them as UTC datetimes.
Every time axis carries the budget changes (``controls`` frame) as vertical markers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeGuard

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from wire.control import CAP_KEY

# One colour per class, none of them the stall rings' red: chat blue, RAG orange, VLM green.
CLASS_COLORS = {
    "chat": "#1f77b4",
    "rag": "#ff7f0e",
    "vlm": "#2ca02c",
    "all": "#7f7f7f",
    None: "#9467bd",
}
# The class whose streams long prompts and images stall: drawn last (in front) and listed first.
STALLED_CLASS = "chat"
DECODE_COLOR = "#1f77b4"
PREFILL_COLOR = "#ff7f0e"
BUDGET_COLOR = "#2f2f2f"
ACCEPTED_MARKER_COLOR = "#8c564b"
REFUSED_MARKER_COLOR = "#bbbbbb"
STALL_COLOR = "#d62728"

# plotly_white with the title at the very top, so the legend row under it never overlaps it
TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
TEMPLATE.layout.title.update(y=0.98, yanchor="top")
LAYOUT = {
    "margin": {"l": 50, "r": 30, "t": 80, "b": 40},
    "legend": {"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    "hovermode": "closest",
    "template": TEMPLATE,
}


def to_datetime(seconds: pd.Series | Iterable[float]) -> pd.Series:
    """Wall seconds since the epoch -> UTC datetimes (for tables and labels)."""
    return pd.to_datetime(pd.Series(seconds, dtype="float64"), unit="s", utc=True)


def to_axis(seconds: pd.Series | Iterable[float]) -> np.ndarray:
    """Wall seconds since the epoch -> milliseconds since the epoch, which a Plotly axis of
    type ``date`` draws as UTC times. Plain floats serialise about ten times faster than
    datetimes, which matters for a Live page redrawn every second."""
    return np.asarray(seconds, dtype="float64") * 1000.0


def class_color(traffic_class: object) -> str:
    if traffic_class is None or (isinstance(traffic_class, float) and math.isnan(traffic_class)):
        return CLASS_COLORS[None]
    return CLASS_COLORS.get(str(traffic_class), "#17becf")


def _empty(fig: go.Figure, text: str) -> go.Figure:
    """``fig`` with ``text`` in its middle and no axes (an empty plot's default ticks, -1 to 6,
    read as data)."""
    fig.add_annotation(
        text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font={"size": 14}
    )
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def control_marker_times(
    controls: pd.DataFrame | None, *, key: str = "token_budget"
) -> pd.DataFrame:
    """The budget changes to draw: one row per control with its time on the axis.

    An accepted change is drawn where it took effect (``applied_at``, the start of the step it
    applied at) when that step has run, else where it was asked for (``time``). A refusal is drawn
    at ``time``. Columns: ``x`` (wall seconds), ``label``, ``accepted``.
    """
    cols = ["x", "label", "accepted"]
    if controls is None or controls.empty:
        return pd.DataFrame(columns=cols)
    rows = controls[controls["key"] == key] if "key" in controls else controls
    out = []
    for r in rows.itertuples(index=False):
        accepted = bool(r.accepted)
        if accepted and _fmt(r.old_value) == _fmt(r.new_value):
            continue  # a status (the autopilot's "holds ..."): nothing changed
        applied_at = getattr(r, "applied_at", None)
        x = applied_at if accepted and _is_number(applied_at) else r.time
        if not _is_number(x):
            continue
        if accepted:
            step = getattr(r, "applied_at_step", None)
            at = f" @ step {int(step)}" if _is_number(step) else ""
            label = f"budget {_fmt(r.old_value)} → {_fmt(r.new_value)}{at}"
        else:
            label = f"refused {_fmt(r.new_value)}"
        out.append({"x": float(x), "label": label, "accepted": accepted})
    return pd.DataFrame(out, columns=cols)


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(float(v))


def _fmt(v: object) -> str:
    if _is_number(v) and float(v) == int(float(v)):
        return str(int(float(v)))
    return str(v)


def add_control_markers(
    fig: go.Figure, controls: pd.DataFrame | None, *, rows: int = 1
) -> go.Figure:
    """Draw each budget change as a vertical line over every subplot row, labelled once on top.

    Shapes and annotations are added by hand (``add_vline`` cannot label a date axis).
    """
    marks = control_marker_times(controls)
    if marks.empty:
        return fig
    times = to_axis(marks["x"])
    for (_, m), t in zip(marks.iterrows(), times, strict=True):
        color = ACCEPTED_MARKER_COLOR if m["accepted"] else REFUSED_MARKER_COLOR
        for row in range(1, rows + 1):
            suffix = "" if row == 1 else str(row)
            fig.add_shape(
                type="line",
                x0=t,
                x1=t,
                y0=0,
                y1=1,
                xref=f"x{suffix}",
                yref=f"y{suffix} domain",
                line={"color": color, "width": 2, "dash": "solid" if m["accepted"] else "dot"},
                name="budget change",
            )
        fig.add_annotation(
            x=t,
            y=0.99,
            xref="x",
            yref="y domain",
            text=m["label"],
            showarrow=False,
            xanchor="left",
            yanchor="top",
            font={"size": 11, "color": color},
            bgcolor="rgba(255,255,255,0.7)",
        )
    return fig


def step_series(
    steps: pd.DataFrame, values: pd.Series | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A step-shaped line (Plotly ``line.shape="hv"``) holding ``values[i]`` from step i's start
    to its end and 0 until the next step starts: two points per step, one SVG path for the whole
    window (a bar per step would be thousands of elements redrawn every second)."""
    n = len(steps)
    x = np.empty(2 * n, dtype="float64")
    x[0::2] = to_axis(steps["start"])
    x[1::2] = to_axis(steps["end"])
    y = np.zeros(2 * n, dtype="float64")
    y[0::2] = np.asarray(values, dtype="float64")
    return x, y


def step_tokens_figure(steps: pd.DataFrame, controls: pd.DataFrame | None = None) -> go.Figure:
    """Tokens per step over time, decode and prefill stacked, each step as wide as it lasted
    (a 2-second prefill step is a 2-second-wide block). The budget in force is a dashed line;
    each step's duration (ms) is on the right axis."""
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.update_layout(**LAYOUT, title="Tokens per step")
    if steps is None or steps.empty:
        return _empty(fig, "no steps in this window")
    decode = steps["num_decode_tokens"].to_numpy(dtype="float64")
    total = decode + steps["num_prefill_tokens"].to_numpy(dtype="float64")
    x, y_decode = step_series(steps, decode)
    _, y_total = step_series(steps, total)
    step_no = np.repeat(steps["step"].to_numpy(), 2)
    prefill = np.repeat(steps["num_prefill_tokens"].to_numpy(), 2)
    fig.add_trace(
        go.Scatter(
            name="decode",
            x=x,
            y=y_decode,
            mode="lines",
            line={"color": DECODE_COLOR, "shape": "hv", "width": 1},
            fill="tozeroy",
            customdata=step_no,
            hovertemplate="step %{customdata}<br>decode %{y}<extra></extra>",
        ),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(
            name="prefill",
            x=x,
            y=y_total,
            mode="lines",
            line={"color": PREFILL_COLOR, "shape": "hv", "width": 1},
            fill="tonexty",
            customdata=np.stack([step_no, prefill], axis=1),
            hovertemplate="step %{customdata[0]}<br>prefill %{customdata[1]}<extra></extra>",
        ),
        secondary_y=False,
    )
    start = to_axis(steps["start"])
    fig.add_trace(
        go.Scatter(
            name="token budget",
            x=start,
            y=steps["token_budget"].to_numpy(),
            mode="lines",
            line={"color": BUDGET_COLOR, "dash": "dash", "shape": "hv"},
        ),
        secondary_y=False,
    )
    fig.add_trace(
        go.Scatter(
            name="step duration (ms)",
            x=start,
            y=steps["duration_ms"].to_numpy(),
            mode="lines",
            line={"color": "#9467bd", "shape": "hv", "width": 1},
        ),
        secondary_y=True,
    )
    fig.update_yaxes(title_text="tokens", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="step ms", secondary_y=True, rangemode="tozero", showgrid=False)
    fig.update_xaxes(title_text="time (UTC)", type="date")
    return add_control_markers(fig, controls)


def stall_mask(itl: pd.DataFrame, *, factor: float = 3.0, floor_ms: float = 0.0) -> pd.Series:
    """Which inter-token latencies are stalls: above ``factor`` x the window's median ITL and
    above ``floor_ms`` (so a 30 ms chunked step among 4 ms decode steps is not called a stall
    when the floor is, say, 100 ms; 0 turns the floor off)."""
    if itl is None or itl.empty:
        return pd.Series([], dtype=bool)
    if not factor > 0:
        raise ValueError(f"stall factor must be > 0, got {factor}")
    if not floor_ms >= 0:
        raise ValueError(f"stall floor must be >= 0 ms, got {floor_ms}")
    limit = max(float(itl["itl_ms"].median()) * factor, floor_ms)
    return itl["itl_ms"] > limit


def itl_figure(
    itl: pd.DataFrame,
    controls: pd.DataFrame | None = None,
    *,
    factor: float = 3.0,
    floor_ms: float = 0.0,
    max_points: int = 10_000,
    stall_notes: pd.Series | None = None,
) -> go.Figure:
    """Every streamed token's inter-token latency over time, one colour per traffic class; stalls
    (see :func:`stall_mask`, over all tokens) ringed in red and counted in the title. Beyond
    ``max_points`` tokens the ordinary ones are thinned evenly; stalls are always drawn.
    ``stall_notes`` (by ``itl``'s index): each stall's hover text (who caused it)."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT)
    if itl is None or itl.empty:
        fig.update_layout(title="Inter-token latency")
        return _empty(fig, "no streamed tokens in this window")
    stalls = stall_mask(itl, factor=factor, floor_ms=floor_ms)
    n_stalls = int(stalls.sum())
    n_all = len(itl)
    if n_all > max_points:
        # Thin the ordinary points evenly (every stall is kept): a minute of 16 streams is
        # ~100,000 points, which no screen shows apart, and each one costs serialisation time.
        stride = -(-n_all // max_points)
        keep = stalls.to_numpy() | (np.arange(n_all) % stride == 0)
        itl, stalls = itl[keep], stalls[keep]
    t = to_axis(itl["time"])
    classes = itl["traffic_class"].astype("object").where(itl["traffic_class"].notna(), None)
    for rank, cls in enumerate(_draw_order(classes)):
        sel = (classes == cls) if cls is not None else classes.isna()
        fig.add_trace(
            go.Scattergl(
                name=str(cls) if cls is not None else "untagged",
                # drawn in front, listed first: the stalled class's points are the story
                legendrank=1 if cls == STALLED_CLASS else 10 + rank,
                x=t[sel.to_numpy()],
                y=itl.loc[sel, "itl_ms"],
                mode="markers",
                marker={"color": class_color(cls), "size": 4, "opacity": 0.7},
                # numbers only: an object array of request ids is copied point by point
                customdata=itl.loc[sel, ["step", "k"]].to_numpy(dtype="float64"),
                hovertemplate="step %{customdata[0]}, token %{customdata[1]}<br>"
                "ITL %{y:.1f} ms<extra></extra>",
            )
        )
    if n_stalls:
        fig.add_trace(
            go.Scattergl(
                name="stall",
                x=t[stalls.to_numpy()],
                y=itl.loc[stalls, "itl_ms"],
                mode="markers",
                marker={
                    "symbol": "circle-open",
                    "size": 11,
                    "color": STALL_COLOR,
                    "line": {"width": 2, "color": STALL_COLOR},
                },
                **(
                    {"hoverinfo": "skip"}
                    if stall_notes is None
                    else {
                        "text": stall_notes.reindex(itl.index[stalls.to_numpy()])
                        .fillna("")
                        .tolist(),
                        "hovertemplate": "%{text}<extra>stall</extra>",
                    }
                ),
            )
        )
    rule = f"> {factor:g}x median" + (f" and > {floor_ms:g} ms" if floor_ms else "")
    shown = "" if len(itl) == n_all else f", {len(itl):,} of {n_all:,} tokens drawn"
    fig.update_layout(title=f"Inter-token latency — {n_stalls} stalls ({rule}){shown}")
    fig.update_yaxes(title_text="ITL (ms)", type="log")
    fig.update_xaxes(title_text="time (UTC)", type="date")
    return add_control_markers(fig, controls)


def _draw_order(classes: pd.Series) -> list[object]:
    """Classes in drawing order: untagged, the others by name, the stalled class last (the
    last trace is drawn on top, so chat points are never hidden under a RAG prompt's)."""
    named = sorted(c for c in classes.dropna().unique().tolist() if c != STALLED_CLASS)
    head: list[object] = [None] if classes.isna().any() else []
    tail: list[object] = [STALLED_CLASS] if (classes == STALLED_CLASS).any() else []
    return head + named + tail


def latency_figure(summary: pd.DataFrame) -> go.Figure:
    """TTFT and TPOT p50/p99 by traffic class (one row per class of ``latency_summary``)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "TPOT (ms)"))
    fig.update_layout(**LAYOUT, barmode="group", title="Latency by class")
    if summary is None or summary.empty:
        return _empty(fig, "no finished requests in this window")
    for col, metric in ((1, "ttft"), (2, "tpot")):
        for q, opacity in (("p50", 0.55), ("p99", 1.0)):
            fig.add_trace(
                go.Bar(
                    name=q,
                    x=summary["traffic_class"].astype(str),
                    y=summary[f"{metric}_{q}_ms"],
                    marker={"color": [class_color(c) for c in summary["traffic_class"]]},
                    opacity=opacity,
                    showlegend=col == 1,
                    legendgroup=q,
                    text=[q] * len(summary),
                    textposition="inside",
                ),
                row=1,
                col=col,
            )
    return fig


def kv_queue_figure(steps: pd.DataFrame, controls: pd.DataFrame | None = None) -> go.Figure:
    """KV cache use (percent of blocks) on top, running and waiting requests below."""
    fig = make_subplots(
        rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=("KV use", "Queue")
    )
    fig.update_layout(**LAYOUT, title="KV cache and queue")
    if steps is None or steps.empty:
        return _empty(fig, "no steps in this window")
    t = to_axis(steps["start"])
    total = steps["kv_blocks_total"].where(steps["kv_blocks_total"] > 0)
    fig.add_trace(
        go.Scatter(
            name="KV use %",
            x=t,
            y=100.0 * steps["kv_blocks_used"] / total,
            mode="lines",
            line={"color": "#17becf", "shape": "hv"},
        ),
        row=1,
        col=1,
    )
    for name, col, color in (
        ("running", "num_running", "#2ca02c"),
        ("waiting", "num_waiting", "#d62728"),
    ):
        fig.add_trace(
            go.Scatter(
                name=name, x=t, y=steps[col], mode="lines", line={"color": color, "shape": "hv"}
            ),
            row=2,
            col=1,
        )
    fig.update_yaxes(title_text="%", range=[0, 100], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(type="date")
    return add_control_markers(fig, controls, rows=2)


def chunk_layout_figure(chunks: pd.DataFrame, *, selected_step: int | None = None) -> go.Figure:
    """The chunk layout of a few steps: one row per step, one segment per scheduled request,
    as many tokens wide as its chunk; prefill and decode in different colours, chunks the
    long-prefill cap kept smaller hatched, the selected step's label in bold. Hover shows the
    request, its class and the positions covered."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT, barmode="stack", title="Chunk layout (tokens in the step)")
    if chunks is None or chunks.empty:
        return _empty(fig, "no chunks for these steps")
    df = chunks.sort_values(["step", "idx"])
    for kind, color in (("decode", DECODE_COLOR), ("prefill", PREFILL_COLOR)):
        sel = df[df["kind"] == kind]
        if sel.empty:
            continue
        end = sel["start"] + sel["num_tokens"]
        capped = (
            sel["capped"].fillna(False).astype(bool)
            if "capped" in sel
            else pd.Series(False, index=sel.index)
        )
        custom = list(
            zip(
                sel["request_id"],
                sel["traffic_class"].astype("object").fillna("untagged"),
                sel["start"],
                end - 1,
                np.where(capped, "<br>capped by long_prefill_token_threshold", ""),
                strict=True,
            )
        )
        fig.add_trace(
            go.Bar(
                name=kind,
                orientation="h",
                y=[_step_label(s, selected_step) for s in sel["step"]],
                x=sel["num_tokens"],
                marker={
                    "color": color,
                    "line": {"width": 1, "color": "white"},
                    "pattern": {"shape": ["/" if c else "" for c in capped]},
                },
                customdata=custom,
                hovertemplate="%{customdata[0]} (%{customdata[1]})<br>positions %{customdata[2]}"
                "–%{customdata[3]}<br>%{x} tokens%{customdata[4]}<extra>" + kind + "</extra>",
            )
        )
    order = [_step_label(s, selected_step) for s in sorted(df["step"].unique())]
    fig.update_yaxes(categoryorder="array", categoryarray=order, title_text="step")
    fig.update_xaxes(title_text="tokens scheduled")
    return fig


def _step_label(step: int, selected: int | None) -> str:
    return (
        f"<b>{int(step)}</b>" if selected is not None and int(step) == selected else str(int(step))
    )


def waterfall_figure(token_times: pd.DataFrame, request: pd.Series | None = None) -> go.Figure:
    """One request's tokens: k against milliseconds since arrival, each token's inter-token
    latency as hover; arrival, first schedule and first token as reference lines."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT, title="Token waterfall")
    if token_times is None or token_times.empty:
        return _empty(fig, "this request produced no tokens")
    t0 = float(token_times["time"].iloc[0])
    if request is not None and _is_number(request.get("arrival")):
        t0 = float(request["arrival"])
    ms = (token_times["time"] - t0) * 1000.0
    itl = token_times["time"].diff() * 1000.0
    fig.add_trace(
        go.Scatter(
            name="token",
            x=ms,
            y=token_times["k"],
            mode="lines+markers",
            line={"shape": "hv", "color": DECODE_COLOR},
            marker={"size": 5},
            customdata=list(zip(token_times["step"], itl.fillna(0.0), strict=True)),
            hovertemplate="token %{y} at %{x:.1f} ms<br>step %{customdata[0]}<br>"
            "ITL %{customdata[1]:.1f} ms<extra></extra>",
        )
    )
    if request is not None:
        marks = (("first_scheduled", "#7f7f7f", 1.0), ("first_token", PREFILL_COLOR, 0.93))
        for name, color, y in marks:
            v = request.get(name)
            if _is_number(v):
                fig.add_vline(x=(float(v) - t0) * 1000.0, line={"color": color, "dash": "dot"})
                fig.add_annotation(
                    x=(float(v) - t0) * 1000.0,
                    y=y,
                    yref="paper",
                    text=name.replace("_", " "),
                    showarrow=False,
                    xanchor="left",
                    font={"color": color},
                )
    fig.update_xaxes(title_text="ms since arrival", rangemode="tozero")
    fig.update_yaxes(title_text="token k")
    return fig


COMPARE_METRICS = (
    ("itl_p50_ms", "ITL p50 (ms)"),
    ("itl_p99_ms", "ITL p99 (ms)"),
    ("itl_p999_ms", "ITL p99.9 (ms)"),
    ("itl_max_ms", "ITL max (ms)"),
    ("ttft_p50_ms", "TTFT p50 (ms)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("tpot_p50_ms", "TPOT p50 (ms)"),
    ("tpot_p99_ms", "TPOT p99 (ms)"),
    ("tokens_per_s", "throughput (tokens/s)"),
    ("num_requests", "requests"),
)


# Which way is better for each metric: -1 lower, +1 higher, 0 neither (a count of requests).
BETTER = {
    "itl_p50_ms": -1,
    "itl_p99_ms": -1,
    "itl_p999_ms": -1,
    "itl_max_ms": -1,
    "ttft_p50_ms": -1,
    "ttft_p99_ms": -1,
    "tpot_p50_ms": -1,
    "tpot_p99_ms": -1,
    "tokens_per_s": 1,
    "num_requests": 0,
}
SAME_WITHIN = 0.05  # a change under 5 % either way is "same": the machine is that noisy
BETTER_MARK = "▲ better"
WORSE_MARK = "▼ worse"
SAME_MARK = "= same"


def verdict(a: object, b: object, direction: int) -> str:
    """B against A for a metric where ``direction`` says which way is better."""
    if direction == 0 or not (_is_number(a) and _is_number(b)):
        return ""
    x, y = float(a), float(b)  # type: ignore[arg-type]
    if x == y or (x != 0 and abs(y / x - 1.0) < SAME_WITHIN):
        return SAME_MARK
    return BETTER_MARK if (y - x) * direction > 0 else WORSE_MARK


def compare_table(a: pd.DataFrame, b: pd.DataFrame, *, traffic_class: str = "all") -> pd.DataFrame:
    """Side by side: one row per metric with ``A``, ``B``, ``B / A``, which way is ``better``
    (lower / higher) and whether ``B vs A`` is better, worse or the same (within 5 %), for one
    traffic class of two ``latency_summary`` frames (missing values stay missing; a ratio over 0
    is missing)."""
    va = _class_row(a, traffic_class)
    vb = _class_row(b, traffic_class)
    rows = []
    for col, label in COMPARE_METRICS:
        x, y = va.get(col), vb.get(col)
        ratio = float(y) / float(x) if _is_number(x) and _is_number(y) and float(x) != 0 else None
        direction = BETTER[col]
        rows.append(
            {
                "metric": label,
                "A": _num(x),
                "B": _num(y),
                "B / A": ratio,
                "better": {-1: "lower", 1: "higher", 0: ""}[direction],
                "B vs A": verdict(x, y, direction),
            }
        )
    return pd.DataFrame(rows, columns=["metric", "A", "B", "B / A", "better", "B vs A"])


def default_compare_class(*summaries: pd.DataFrame | None) -> str:
    """The traffic class Compare opens on: the stalled streams (chat) when either side has
    them, else every request."""
    for s in summaries:
        if s is not None and not s.empty and (s["traffic_class"] == STALLED_CLASS).any():
            return STALLED_CLASS
    return "all"


def _num(v: object) -> float | None:
    return float(v) if _is_number(v) else None


def class_value(summary: pd.DataFrame | None, traffic_class: str, column: str) -> float | None:
    """One figure of one class's row of a ``latency_summary`` frame (None when missing)."""
    return _num(_class_row(summary, traffic_class).get(column))


def _class_row(summary: pd.DataFrame | None, traffic_class: str) -> dict[str, object]:
    if summary is None or summary.empty:
        return {}
    sel = summary[summary["traffic_class"] == traffic_class]
    return {} if sel.empty else sel.iloc[0].to_dict()


def compare_figure(table: pd.DataFrame, *, names: tuple[str, str] = ("A", "B")) -> go.Figure:
    """The latency rows of :func:`compare_table` as grouped bars (A next to B)."""
    fig = go.Figure()
    fig.update_layout(**LAYOUT, barmode="group", title="A vs B (ms)")
    lat = table[table["metric"].str.endswith("(ms)")]
    if lat.empty or lat[["A", "B"]].isna().all().all():
        return _empty(fig, "nothing to compare yet")
    for col, name, color in (("A", names[0], "#7f7f7f"), ("B", names[1], "#1f77b4")):
        fig.add_trace(go.Bar(name=name, x=lat["metric"], y=lat[col], marker={"color": color}))
    fig.update_yaxes(title_text="ms", type="log")
    return fig


AUTOPILOT_COLOR = "#9467bd"
PREDICTED_COLOR = "#e377c2"


def _binned_p99(times: pd.Series, values: pd.Series, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """p99 of ``values`` per ``bin_s``-second bin of ``times`` (bin centres, wall seconds)."""
    if len(times) == 0:
        return np.empty(0), np.empty(0)
    t = np.asarray(times, dtype="float64")
    v = np.asarray(values, dtype="float64")
    bins = np.floor(t / bin_s)
    df = pd.DataFrame({"b": bins, "v": v})
    g = df.groupby("b")["v"].quantile(0.99)
    return (g.index.to_numpy() + 0.5) * bin_s, g.to_numpy()


def autopilot_figure(
    events: pd.DataFrame,
    itl: pd.DataFrame | None,
    requests: pd.DataFrame | None,
    *,
    bin_s: float = 2.0,
) -> go.Figure:
    """The autopilot over time: the budget and cap it set (top), the chat ITL p99 observed per
    ``bin_s`` bin beside what it predicted (middle), each request's TTFT beside the TTFT p99 it
    predicted (bottom). ``events`` is ``dashboard.autopilot.autopilot_events``."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=(
            "Setting chosen by the autopilot",
            "Chat ITL p99: observed vs predicted",
            "TTFT: observed vs predicted p99",
        ),
    )
    fig.update_layout(**LAYOUT)
    fig.update_layout(height=620, legend={"orientation": "h", "y": -0.08})
    if events.empty:
        return _empty(fig, "The autopilot has not stored a decision in this window")
    for key, name, dash in (("token_budget", "budget", "solid"), (CAP_KEY, "cap", "dot")):
        ev = events[events["key"] == key]
        if ev.empty:
            continue
        fig.add_trace(
            go.Scatter(
                x=to_axis(ev["time"]),
                y=pd.to_numeric(ev["new_value"], errors="coerce"),
                mode="lines+markers",
                line={"shape": "hv", "color": AUTOPILOT_COLOR, "dash": dash},
                name=f"{name} (autopilot)",
                text=ev["reason"],
                hovertemplate="%{y}<br>%{text}<extra></extra>",
            ),
            row=1,
            col=1,
        )
    if itl is not None and not itl.empty:
        chat = itl[itl["traffic_class"] == STALLED_CLASS]
        chat = chat if not chat.empty else itl
        x, y = _binned_p99(chat["time"], chat["itl_ms"], bin_s)
        fig.add_trace(
            go.Scatter(x=to_axis(x), y=y, mode="lines", name=f"observed ITL p99 ({bin_s:g} s)",
                       line={"color": DECODE_COLOR}),
            row=2, col=1,
        )  # fmt: skip
    pred = events.dropna(subset=["pred_itl_p99_ms"])
    fig.add_trace(
        go.Scatter(x=to_axis(pred["time"]), y=pred["pred_itl_p99_ms"], mode="markers",
                   name="predicted ITL p99", marker={"color": PREDICTED_COLOR, "size": 9,
                   "symbol": "diamond"}),
        row=2, col=1,
    )  # fmt: skip
    if requests is not None and not requests.empty:
        r = requests.dropna(subset=["first_token", "ttft_ms"])
        fig.add_trace(
            go.Scatter(x=to_axis(r["arrival"]), y=r["ttft_ms"], mode="markers",
                       name="observed TTFT", marker={"color": "#7f7f7f", "size": 5}),
            row=3, col=1,
        )  # fmt: skip
    pred = events.dropna(subset=["pred_ttft_p99_ms"])
    fig.add_trace(
        go.Scatter(x=to_axis(pred["time"]), y=pred["pred_ttft_p99_ms"], mode="markers",
                   name="predicted TTFT p99", marker={"color": PREDICTED_COLOR, "size": 9,
                   "symbol": "diamond"}),
        row=3, col=1,
    )  # fmt: skip
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="ms", row=3, col=1)
    fig.update_xaxes(type="date")
    return fig
