"""Compare: two windows of one run (before and after a budget change), two runs, or two
engines over the same wall-clock window (ours and vLLM on the same traffic), side by side: ITL
p50/p99/p99.9/max, TTFT p50/p99, TPOT, throughput, and each ratio."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import blame_charts, blame_data, charts, data, story, ui

st.header("Compare")
ctx = ui.context()
if ctx.empty:
    ui.empty_store_help(ctx)
    st.stop()
stall_specs: tuple[tuple[float, float], tuple[float, float]] | None = None
# (engine id, run id, since, until) of A and B
specs: list[tuple[str | None, str | None, float | None, float | None]]
mode = st.radio(
    "Compare",
    ["Before / after a budget change", "Two windows", "Two runs", "Two engines"],
    horizontal=True,
)
if mode == "Two runs":
    rows = ctx.engines.to_dict("records")
    labels = [ui.run_label(r) for r in rows]
    c1, c2 = st.columns(2)
    a_label = c1.selectbox("Run A", labels, index=min(1, len(labels) - 1))
    b_label = c2.selectbox("Run B", labels, index=0)
    ra, rb = rows[labels.index(a_label)], rows[labels.index(b_label)]
    specs = [
        (ra["engine_id"], ra["run_id"], None, None),
        (rb["engine_id"], rb["run_id"], None, None),
    ]
    names = ("A: " + a_label, "B: " + b_label)
elif mode == "Two engines":
    # each engine's newest run (the engines frame is newest first), over one wall-clock window
    # ending where the earlier of the two last reported: the same traffic when one load drives
    # both (or two loads start together)
    newest = ctx.engines.drop_duplicates("engine_id").to_dict("records")
    ids = [r["engine_id"] for r in newest]
    if len(ids) < 2:
        st.info("Only one engine in the store: start another (e.g. `chunkscope vllm`) on the "
                "same traffic to compare them.")  # fmt: skip
        st.stop()
    c1, c2, c3 = st.columns(3)
    a_id = c1.selectbox("Engine A", ids, index=1, key="compare_engine_a")
    b_id = c2.selectbox("Engine B", ids, index=0, key="compare_engine_b")
    width = c3.select_slider(
        "Window (s)", options=[30, 60, 120, 300, 600, 1800], value=300, key="compare_engine_w"
    )
    ra, rb = newest[ids.index(a_id)], newest[ids.index(b_id)]
    ends = [pd.to_numeric(r["last_time"], errors="coerce") for r in (ra, rb)]
    if any(pd.isna(e) for e in ends):
        st.info("One of the two engines has no steps yet.")
        st.stop()
    end = float(min(ends))
    specs = [
        (ra["engine_id"], ra["run_id"], end - width, end),
        (rb["engine_id"], rb["run_id"], end - width, end),
    ]
    when = charts.to_datetime([end]).iloc[0]
    names = (f"A: {a_id}", f"B: {b_id}")
    st.caption(f"Both engines over the same {width} s ending {when:%H:%M:%S}.")
    apart = ui.span_notes(
        [ra, rb], end - width, end, fmt=lambda t: f"{charts.to_datetime([t]).iloc[0]:%H:%M:%S}"
    )
    if apart:
        st.warning(
            "The two engines did not run over the same span: "
            + "; ".join(apart)
            + ". Only this window is compared: drive both with the same traffic at the same "
            "time (or pick a window where both ran) for a fair comparison."
        )
elif mode == "Two windows":
    latest = ctx.latest
    if latest is None:
        st.info("No steps yet.")
        st.stop()
    c1, c2 = st.columns(2)
    width = c1.select_slider("Window (s)", options=[10, 30, 60, 120, 300, 600], value=30)
    ago = c2.number_input(
        "A ends this many seconds before B (B = the newest window)",
        min_value=float(width),
        value=float(2 * width),
        step=10.0,
    )
    specs = [
        (ctx.engine_id, ctx.run_id, latest - ago - width, latest - ago),
        (ctx.engine_id, ctx.run_id, latest - width, latest),
    ]
    names = (f"A: {width} s ending {ago:g} s earlier", f"B: the last {width} s")
else:
    if ctx.run is None:
        st.info("Pick one engine in the sidebar to compare before and after its changes.")
        st.stop()
    try:
        ctrl = data.controls(ctx.db_url, ctx.engine_id, ctx.run_id)
    except data.StoreUnavailable as exc:
        st.warning(str(exc))
        st.stop()
    marks = charts.control_marker_times(ctrl)
    marks = marks[marks["accepted"]] if not marks.empty else marks
    if marks.empty:
        st.info("No accepted budget change in this run yet: change it on the Control page.")
        st.stop()
    options = list(reversed(range(len(marks))))
    labels = [
        f"{marks.iloc[i]['label']} at {charts.to_datetime([marks.iloc[i]['x']]).iloc[0]:%H:%M:%S}"
        for i in options
    ]
    pick = st.selectbox("Change", labels)
    t = float(marks.iloc[options[labels.index(pick)]]["x"])
    side: object = st.select_slider(
        "Window each side (s)",
        options=["auto", 10, 20, 30, 60, 120, 300],
        value="auto",
        help="auto: back to the previous change and on to the next (or the newest data), "
        f"{story.MAX_WINDOW_S:.0f} s at most each side, so that each side holds the long "
        "prompts that stalled streams in that time",
    )
    others = [float(x) for x in marks["x"] if float(x) != t]
    first = pd.to_numeric(ctx.run.get("started"), errors="coerce")
    win = story.change_windows(
        t,
        others,
        first=None if pd.isna(first) else float(first),
        latest=ctx.latest,
        max_s=story.MAX_WINDOW_S if side == "auto" else float(str(side)),
    )
    if win.after is None:
        st.info("Nothing after this change yet: the page fills in as steps arrive.")
        st.stop()
    specs = [
        (ctx.engine_id, ctx.run_id, *win.before),
        (ctx.engine_id, ctx.run_id, *win.after),
    ]
    span = [f"{hi - lo:.0f} s" for lo, hi in (win.before, win.after)]
    names = (f"A: {span[0]} before", f"B: {span[1]} after")
    stall_specs = (win.before, win.after)

try:
    a, b = (data.latency_summary(ctx.db_url, e, r, s, u) for e, r, s, u in specs)
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()
CLASSES = ["all", "chat", "rag", "vlm"]
# the stalled streams (chat) when there are any: their latencies are what a budget cut is for
cls = st.selectbox(
    "Traffic class",
    CLASSES,
    index=CLASSES.index(charts.default_compare_class(a, b)),
    help="chat: the streams that long prompts and images stall",
)
if stall_specs is not None and ctx.engine_id and ctx.run_id:
    what = "chat" if cls == "chat" else "stream"
    try:
        sa, sb = (
            data.stall_window(
                ctx.db_url, ctx.engine_id, ctx.run_id, lo, hi, None if cls == "all" else cls
            )
            for lo, hi in stall_specs
        )
    except data.StoreUnavailable as exc:
        st.warning(str(exc))
    else:
        waiting = story.waiting_line(sa, sb, what)
        if waiting:
            st.info(waiting)
        else:
            st.markdown(story.headline(sa, sb, what))
            ttft = (
                charts.class_value(a, cls, "ttft_p99_ms"),
                charts.class_value(b, cls, "ttft_p99_ms"),
            )
            for line in story.detail_lines(sa, sb, what, ttft):
                st.markdown(line)
            cols = st.columns(4)
            figures = [
                ("Worst stall (ms)", sa.stall_max_ms, sb.stall_max_ms, ""),
                ("Stall p99.9 (ms)", sa.stall_p999_ms, sb.stall_p999_ms, ""),
                ("Long-prompt TTFT p50 (ms)", sa.long_ttft_p50_ms, sb.long_ttft_p50_ms,
                 " (the cost of chunking)"),
            ]  # fmt: skip
            for col, (label, before, after, note) in zip(cols[:2] + cols[3:], figures, strict=True):
                col.metric(
                    label,
                    story.ms_value(after),
                    story.times(before, after) or None,
                    delta_color=story.delta_color(before, after),
                    delta_arrow=story.delta_arrow(before, after),
                    help=f"before: {story.ms_value(before)} ms{note}",
                )
            cols[2].metric(
                "Long prompts that stalled streams",
                f"{sa.long_met} → {sb.long_met}",
                help="long prompts or images whose prefill lay inside a stream's gap",
            )
table = charts.compare_table(a, b, traffic_class=cls)
st.caption(
    f"{names[0]}  vs  {names[1]} · traffic class {cls} · `better`: which way is better; "
    "`B vs A`: ▲ better, ▼ worse, = within 5 %"
)
MARK_STYLE = {
    charts.BETTER_MARK: "color: #1a7f37; font-weight: 600",
    charts.WORSE_MARK: "color: #cf222e; font-weight: 600",
}
styled = table.style.format({"A": "{:.1f}", "B": "{:.1f}", "B / A": "{:.2f}x"}, na_rep="—").map(
    lambda v: MARK_STYLE.get(v, ""), subset=["B vs A"]
)
st.dataframe(styled, hide_index=True)
st.plotly_chart(charts.compare_figure(table, names=names), key="compare_fig")


# ---- who caused the stalls: the blame ledger per side -------------------------------------
st.subheader("Who caused the stalls")
caused: dict[str, pd.DataFrame] = {}
notes = []
for name, (e_id, r_id, lo, hi) in zip(names, specs, strict=True):
    if e_id is None or r_id is None:
        notes.append(f"{name}: pick one engine")
        continue
    try:
        if hi is None:
            last = data.steps(ctx.db_url, e_id, r_id, limit=1)
            hi = None if last.empty else float(last["end"].iloc[0])
        if hi is not None and (lo is None or hi - lo > blame_data.MAX_WINDOW_S):
            lo = hi - blame_data.MAX_WINDOW_S  # the newest part of a long window
        _, by_class, excess = blame_data.window_blame(ctx.db_url, e_id, r_id, lo, hi)
    except (data.StoreUnavailable, blame_data.BlameUnavailable) as exc:
        notes.append(f"{name}: {exc}")
        continue
    caused[name] = by_class
    notes.append(
        f"{name}: {excess / 1e3:.1f} s of excess, caused by "
        f"{blame_charts.class_cost_line(by_class)}"
    )
for note in notes:
    st.markdown(f"- {note}")
st.plotly_chart(blame_charts.class_cost_figure(caused), key="compare_blame_fig")
