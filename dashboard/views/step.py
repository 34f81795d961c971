"""Step: one step's chunk layout (which requests, prefill or decode, which positions) and its
neighbours. Pick a step by number or click one in the timeline."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, ui

NEIGHBOURS = 3

st.header("Step")
ctx = ui.context()
if ctx.empty:
    ui.empty_store_help(ctx)
    st.stop()
if ctx.run is None:
    st.info("Pick one engine in the sidebar to see its steps.")
    st.stop()
run = ctx.run
last = run.get("last_step")
if last is None or last != last:  # None or NaN: no steps yet
    st.info("This engine has not run a step yet.")
    st.stop()
last = int(last)

try:
    recent = data.steps(ctx.db_url, ctx.engine_id, ctx.run_id, since=(run["last_time"] or 0) - 30)
    ctrl = data.controls(ctx.db_url, ctx.engine_id, ctx.run_id)
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()

fig = charts.step_tokens_figure(recent, ctrl)
fig.update_layout(height=300, title="Last 30 s — click the chart to pick a step")
event = st.plotly_chart(fig, key="step_pick", on_select="rerun", selection_mode="points")
picked = None
try:
    points = event.selection.points if event is not None else []
    if points:
        picked = int(points[0]["customdata"])
except (AttributeError, KeyError, TypeError, ValueError, IndexError):
    picked = None
if picked is not None:
    st.session_state["step_number"] = picked

step = int(
    st.number_input(
        "Step",
        min_value=0,
        max_value=last,
        value=min(last, st.session_state.get("step_number", last)),
        step=1,
        key="step_number",
    )
)
lo, hi = max(0, step - NEIGHBOURS), min(last, step + NEIGHBOURS)
try:
    chunks = data.step_chunks(ctx.db_url, ctx.engine_id, ctx.run_id, lo, hi)
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()
st.plotly_chart(charts.chunk_layout_figure(chunks, selected_step=step), key="step_layout")
# the step's own numbers come from the timeline already read (the last 30 s): the store's step
# query selects by time, and reading a whole run to find one old step would be slow
this = recent[recent["step"] == step] if not recent.empty else recent
if this.empty:
    st.caption("Budget, duration and queue numbers are shown for steps of the last 30 s.")
else:
    r = this.iloc[0]
    cols = st.columns(6)
    cols[0].metric("budget", int(r["token_budget"]))
    cols[1].metric(
        "decode / prefill", f"{int(r['num_decode_tokens'])} / {int(r['num_prefill_tokens'])}"
    )
    cols[2].metric("duration", f"{r['duration_ms']:.1f} ms")
    cols[3].metric("running / waiting", f"{int(r['num_running'])} / {int(r['num_waiting'])}")
    cols[4].metric("KV blocks", f"{int(r['kv_blocks_used'])} / {int(r['kv_blocks_total'])}")
    cap = r.get("long_prefill_token_threshold")
    cols[5].metric(
        "long-prefill cap",
        "—" if cap is None or cap != cap else (int(cap) or "off"),
        help="long_prefill_token_threshold in force; hatched chunks were kept smaller by it",
    )
st.subheader(f"Chunks of step {step}")
st.dataframe(
    chunks[chunks["step"] == step].drop(columns=["engine_id", "run_id"], errors="ignore"),
    hide_index=True,
)
