"""Chart functions on fixed DataFrames: traces, stalls, markers, empty inputs."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import pytest

from dashboard import charts
from tests.dashboard.frames import (
    chunks_frame,
    controls_frame,
    itl_frame,
    steps_frame,
    summary_frame,
)


def _trace(fig: go.Figure, name: str) -> go.BaseTraceType:
    found = [t for t in fig.data if t.name == name]
    assert found, f"no trace {name!r} in {[t.name for t in fig.data]}"
    return found[0]


def _marker_shapes(fig: go.Figure) -> list:
    return [s for s in fig.layout.shapes if s.type == "line"]


def test_step_tokens_stacks_decode_and_prefill_with_budget_and_duration() -> None:
    steps = steps_frame(10)
    fig = charts.step_tokens_figure(steps, controls_frame())
    decode, prefill = _trace(fig, "decode"), _trace(fig, "prefill")
    # two points per step: its value from its start, 0 from its end (a block as wide as the step)
    assert list(decode.y) == [4, 0] * 10
    assert list(prefill.y[:4]) == [1004, 0, 4, 0]  # stacked: decode + prefill
    assert decode.line.shape == prefill.line.shape == "hv"
    assert (decode.fill, prefill.fill) == ("tozeroy", "tonexty")
    x = list(decode.x)
    assert x[0] == pytest.approx(steps["start"].iloc[0] * 1000)
    assert x[1] - x[0] == pytest.approx(500.0)  # the prefill step lasted 0.5 s
    assert x[3] - x[2] == pytest.approx(10.0)
    assert fig.layout.xaxis.type == "date"
    assert list(_trace(fig, "token budget").y) == [2048] * 10
    duration = _trace(fig, "step duration (ms)")
    assert duration.yaxis == "y2"
    assert list(duration.y[:2]) == pytest.approx([500.0, 10.0])


def test_budget_changes_are_markers_accepted_at_applied_time_refused_dotted() -> None:
    ctrl = controls_frame()
    marks = charts.control_marker_times(ctrl)
    # only token_budget rows: the policy change is not a budget marker
    assert len(marks) == 2
    accepted, refused = marks.iloc[0], marks.iloc[1]
    assert accepted["accepted"] and accepted["x"] == pytest.approx(ctrl["applied_at"].iloc[0])
    assert accepted["label"] == "budget 2048 → 256 @ step 7"
    assert not refused["accepted"] and refused["x"] == pytest.approx(ctrl["time"].iloc[1])
    fig = charts.step_tokens_figure(steps_frame(10), ctrl)
    shapes = _marker_shapes(fig)
    assert [s.line.dash for s in shapes] == ["solid", "dot"]
    assert any("2048 → 256" in a.text for a in fig.layout.annotations)


def test_accepted_change_not_yet_applied_is_drawn_when_asked() -> None:
    ctrl = controls_frame().iloc[[0]].copy()
    ctrl["applied_at"] = None
    marks = charts.control_marker_times(ctrl)
    assert marks["x"].iloc[0] == pytest.approx(ctrl["time"].iloc[0])


def test_every_time_axis_carries_the_markers() -> None:
    ctrl = controls_frame()
    steps = steps_frame(10)
    itl = itl_frame([10, 11, 12, 200, 10, 9])
    for fig, rows in (
        (charts.step_tokens_figure(steps, ctrl), 1),
        (charts.itl_figure(itl, ctrl), 1),
        (charts.kv_queue_figure(steps, ctrl), 2),
    ):
        shapes = _marker_shapes(fig)
        assert len(shapes) == 2 * rows
        assert {s.xref for s in shapes} == ({"x"} if rows == 1 else {"x", "x2"})


def test_stalls_are_itl_above_factor_times_median_and_the_floor() -> None:
    itl = itl_frame([10, 10, 10, 10, 35, 10, 500])
    assert charts.stall_mask(itl, factor=3.0).tolist() == [False] * 4 + [True, False, True]
    assert charts.stall_mask(itl, factor=3.0, floor_ms=100).tolist() == [False] * 6 + [True]
    assert not charts.stall_mask(itl, factor=100.0).any()
    with pytest.raises(ValueError, match="stall factor"):
        charts.stall_mask(itl, factor=0)
    with pytest.raises(ValueError, match="floor"):
        charts.stall_mask(itl, floor_ms=-1)


def test_itl_figure_colours_by_class_and_rings_stalls() -> None:
    itl = itl_frame([10, 12, 11, 400, 10, 9], classes=["chat", "chat", "rag", "chat", None, "vlm"])
    fig = charts.itl_figure(itl)
    assert {t.name for t in fig.data} == {"chat", "rag", "vlm", "untagged", "stall"}
    assert list(_trace(fig, "chat").y) == [10, 12, 400]
    assert _trace(fig, "chat").marker.color == charts.CLASS_COLORS["chat"]
    stall = _trace(fig, "stall")
    assert list(stall.y) == [400]
    assert "1 stalls" in fig.layout.title.text
    assert fig.layout.yaxis.type == "log"


def test_no_stall_trace_when_nothing_stalls() -> None:
    fig = charts.itl_figure(itl_frame([10, 11, 12]))
    assert "stall" not in {t.name for t in fig.data}
    assert "0 stalls" in fig.layout.title.text


@pytest.mark.parametrize(
    "make",
    [
        lambda: charts.step_tokens_figure(pd.DataFrame()),
        lambda: charts.itl_figure(pd.DataFrame()),
        lambda: charts.latency_figure(pd.DataFrame()),
        lambda: charts.kv_queue_figure(pd.DataFrame()),
        lambda: charts.chunk_layout_figure(pd.DataFrame()),
        lambda: charts.waterfall_figure(pd.DataFrame()),
    ],
)
def test_empty_frames_give_an_annotated_empty_figure(make) -> None:
    fig = make()
    assert len(fig.data) == 0
    assert any("no " in a.text or "produced no" in a.text for a in fig.layout.annotations)
    # no axes: an empty plot's default ticks (-1 to 6) would read as data
    axes = [fig.layout[k] for k in fig.layout if k.startswith(("xaxis", "yaxis"))]
    assert axes and all(ax.visible is False for ax in axes)


def test_latency_figure_has_p50_and_p99_per_class_for_ttft_and_tpot() -> None:
    fig = charts.latency_figure(summary_frame())
    assert len(fig.data) == 4
    ttft_p99 = [t for t in fig.data if t.name == "p99" and t.xaxis == "x"][0]
    assert list(ttft_p99.x) == ["chat", "rag", "all"]
    assert list(ttft_p99.y) == [200, 200, 200]


def test_kv_queue_figure_percent_and_queue() -> None:
    steps = steps_frame(3, prefill_every=0)
    fig = charts.kv_queue_figure(steps)
    assert list(_trace(fig, "KV use %").y) == pytest.approx([10.0, 11.0, 12.0])
    assert list(_trace(fig, "waiting").y) == [0, 1, 2]
    assert list(_trace(fig, "running").y) == [5, 5, 5]


def test_chunk_layout_one_row_per_step_segments_by_kind() -> None:
    fig = charts.chunk_layout_figure(chunks_frame(), selected_step=5)
    decode, prefill = _trace(fig, "decode"), _trace(fig, "prefill")
    assert list(decode.x) == [1] * 9
    assert list(prefill.x) == [256, 256, 256]
    assert list(prefill.y) == ["4", "<b>5</b>", "6"]
    assert list(fig.layout.yaxis.categoryarray) == ["4", "<b>5</b>", "6"]
    # hover: request, class (untagged when None), first and last position
    assert list(prefill.customdata[1]) == ["rag-0", "untagged", 256, 511, ""]
    assert list(prefill.marker.pattern.shape) == ["", "", ""]  # none capped (older stores)


def test_chunk_layout_hatches_capped_chunks() -> None:
    chunks = chunks_frame()
    chunks["capped"] = (chunks["kind"] == "prefill") & (chunks["step"] == 5)
    prefill = _trace(charts.chunk_layout_figure(chunks), "prefill")
    assert list(prefill.marker.pattern.shape) == ["", "/", ""]
    assert "long_prefill_token_threshold" in prefill.customdata[1][4]


def test_waterfall_times_are_ms_since_arrival() -> None:
    times = pd.DataFrame(
        {"k": [1, 2, 3], "time": [100.5, 100.6, 101.6], "step": [3, 4, 9], "time_ns": [0, 1, 2]}
    )
    req = pd.Series({"arrival": 100.0, "first_scheduled": 100.1, "first_token": 100.5})
    fig = charts.waterfall_figure(times, req)
    tok = _trace(fig, "token")
    assert list(tok.x) == pytest.approx([500.0, 600.0, 1600.0])
    assert list(tok.y) == [1, 2, 3]
    assert [c[1] for c in tok.customdata] == pytest.approx([0.0, 100.0, 1000.0])


def test_compare_table_ratios_and_missing_values() -> None:
    a, b = summary_frame(1.0), summary_frame(0.5)
    table = charts.compare_table(a, b)
    row = table.set_index("metric").loc["ITL p99 (ms)"]
    assert row["A"] == 400 and row["B"] == 200 and row["B / A"] == pytest.approx(0.5)
    tput = table.set_index("metric").loc["throughput (tokens/s)"]
    assert tput["B / A"] == pytest.approx(2.0)
    empty = charts.compare_table(a, pd.DataFrame())
    assert empty["B"].isna().all() and empty["B / A"].isna().all()
    fig = charts.compare_figure(table)
    assert [t.name for t in fig.data] == ["A", "B"]
    assert len(charts.compare_figure(empty).data) == 2  # A is drawn, B is empty


def test_compare_marks_say_which_way_is_better_and_whether_b_is() -> None:
    a = summary_frame(1.0)
    b = summary_frame(0.5)  # latencies halved, throughput doubled: better everywhere
    t = charts.compare_table(a, b, traffic_class="chat").set_index("metric")
    assert t.loc["ITL max (ms)", "better"] == "lower"
    assert t.loc["ITL max (ms)", "B vs A"] == charts.BETTER_MARK
    assert t.loc["throughput (tokens/s)", "better"] == "higher"
    assert t.loc["throughput (tokens/s)", "B vs A"] == charts.BETTER_MARK
    assert t.loc["requests", "better"] == "" and t.loc["requests", "B vs A"] == ""
    # the other way round: a higher ITL is worse even though its ratio is above 1
    w = charts.compare_table(b, a, traffic_class="chat").set_index("metric")
    assert w.loc["ITL p99 (ms)", "B / A"] == pytest.approx(2.0)
    assert w.loc["ITL p99 (ms)", "B vs A"] == charts.WORSE_MARK
    assert w.loc["throughput (tokens/s)", "B vs A"] == charts.WORSE_MARK
    # within 5 % is the same; a missing side has no mark
    assert charts.verdict(100.0, 103.0, -1) == charts.SAME_MARK
    assert charts.verdict(100.0, 94.0, -1) == charts.BETTER_MARK
    assert charts.verdict(100.0, None, -1) == ""
    # every metric has a direction
    assert {c for c, _ in charts.COMPARE_METRICS} == set(charts.BETTER)


def test_compare_opens_on_the_stalled_class_when_present() -> None:
    assert charts.default_compare_class(summary_frame(), summary_frame()) == "chat"
    no_chat = summary_frame()
    no_chat = no_chat[no_chat["traffic_class"] != "chat"]
    assert charts.default_compare_class(no_chat, no_chat) == "all"
    assert charts.default_compare_class(pd.DataFrame(), summary_frame()) == "chat"
    assert charts.default_compare_class(None, pd.DataFrame()) == "all"


def test_itl_chart_draws_chat_in_front_and_lists_it_first() -> None:
    itl = itl_frame([10, 12, 11, 400, 10, 9], classes=["rag", "chat", "vlm", "chat", None, "rag"])
    fig = charts.itl_figure(itl)
    names = [t.name for t in fig.data]
    assert names == ["untagged", "rag", "vlm", "chat", "stall"]  # last drawn = in front
    chat = _trace(fig, "chat")
    assert chat.legendrank < min(_trace(fig, n).legendrank for n in ("rag", "vlm", "untagged"))
    colours = [_trace(fig, n).marker.color for n in ("chat", "rag", "vlm", "untagged")]
    assert len(set(colours)) == 4 and charts.STALL_COLOR not in colours


def test_charts_never_import_streamlit() -> None:
    import ast
    from pathlib import Path

    tree = ast.parse(Path(charts.__file__).read_text())
    names = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(n.startswith("streamlit") for n in names)


def test_many_tokens_are_thinned_but_every_stall_is_kept() -> None:
    values = [10.0] * 1000
    for i in (3, 500, 999):
        values[i] = 300.0
    fig = charts.itl_figure(itl_frame(values), max_points=100)
    drawn = sum(len(t.y) for t in fig.data if t.name != "stall")
    assert drawn < 110
    assert list(_trace(fig, "stall").y) == [300.0] * 3
    assert "3 stalls" in fig.layout.title.text and "of 1,000 tokens drawn" in fig.layout.title.text
