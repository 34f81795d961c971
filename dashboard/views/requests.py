"""Requests: per-request latencies, and one request's token waterfall."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, data, ui

COLUMNS = [
    "request_id",
    "traffic_class",
    "num_prompt_tokens",
    "num_image_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "ttft_ms",
    "tpot_ms",
    "max_itl_ms",
    "e2e_ms",
    "finish_reason",
]

st.header("Requests")
ctx = ui.context()
if ctx.empty:
    ui.empty_store_help(ctx)
    st.stop()
c1, c2 = st.columns(2)
cls = c1.selectbox("Traffic class", ["all", "chat", "rag", "vlm"])
minutes = c2.select_slider("Last minutes", options=[1, 5, 15, 60, 24 * 60], value=15)
latest = ctx.latest
since = None if latest is None else latest - 60 * minutes
try:
    reqs = data.requests(
        ctx.db_url, ctx.engine_id, ctx.run_id, since, None, None if cls == "all" else cls
    )
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()
if reqs.empty:
    st.info("No requests in this window. Start traffic from the sidebar.")
    st.stop()
st.caption(f"{len(reqs)} requests")
st.dataframe(reqs[[c for c in COLUMNS if c in reqs]].round(1), hide_index=True, height=320)

worst = reqs.sort_values("max_itl_ms", ascending=False, na_position="last")
ids = worst["request_id"].tolist()
rid = st.selectbox("Request (worst stall first)", ids, key="request_pick")
row = worst[worst["request_id"] == rid].iloc[0]
try:
    times = data.token_times(ctx.db_url, row["engine_id"], row["run_id"], rid)
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()
cols = st.columns(4)
for col, (name, key) in zip(
    cols,
    [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("max ITL", "max_itl_ms"), ("end to end", "e2e_ms")],
    strict=True,
):
    v = row.get(key)
    col.metric(name, "—" if v is None or v != v else f"{v:.1f} ms")
st.plotly_chart(charts.waterfall_figure(times, row), key="waterfall")
