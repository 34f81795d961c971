"""Requests: per-request latencies, and one request's token waterfall."""

from __future__ import annotations

import streamlit as st

from dashboard import blame_charts, blame_data, charts, data, ui

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
# a request to open on (the Live page's stall picker): shown whatever its class
focus = st.session_state.pop("requests_focus", None)
if focus is not None:
    st.session_state["requests_class"] = "all"
c1, c2 = st.columns(2)
cls = c1.selectbox("Traffic class", ["all", "chat", "rag", "vlm"], key="requests_class")
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
if focus is not None:
    if focus in ids:
        st.session_state["request_pick"] = focus
    else:
        st.info(f"{focus} is not among the requests of the last {minutes} minutes.")
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

# ---- who slowed it: the blame ledger ---------------------------------------------------------
st.subheader("Who slowed it")
try:
    blame, gaps = blame_data.request_blame(
        ctx.db_url, str(row["engine_id"]), str(row["run_id"]), str(rid)
    )
except (data.StoreUnavailable, blame_data.BlameUnavailable) as exc:
    st.info(f"No ledger for this request: {exc}")
else:
    cols = st.columns(4)
    cols[0].metric(
        "Excess",
        f"{blame['excess_ms']:.0f} ms",
        help="its time beyond its own work and the engine's pauses: what the other requests "
        "in its steps cost it",
    )
    cols[1].metric(
        "Of it, queued",
        f"{blame['queue_ms']:.0f} ms",
        help="steps it waited through without a chunk while others held the budget",
    )
    cols[2].metric("Stalls", f"{blame['num_stalls']} of {blame['num_gaps']} gaps")
    top = blame["culprits"][0] if blame["culprits"] else None
    cols[3].metric(
        "Top culprit",
        "—" if top is None else f"{top['ms']:.0f} ms",
        help=None if top is None else str(top["request_id"]),
    )
    if top is not None:
        st.caption(
            f"Most of it: **{top['request_id']}** ({top.get('traffic_class') or 'no class'}, "
            f"{top.get('num_prompt_tokens') or '?'} prompt tokens), {top['ms']:.0f} ms over "
            f"{top['gaps']} of its gaps."
        )
        if st.button(f"Replay without {top['request_id']}", key="replay_without"):
            try:
                gain, blamed_ms = blame_data.replay_without(
                    ctx.db_url, str(row["engine_id"]), str(row["run_id"]), str(rid),
                    str(top["request_id"]),
                )  # fmt: skip
            except (data.StoreUnavailable, blame_data.BlameUnavailable) as exc:
                st.info(f"No replay: {exc}")
            else:
                st.markdown(blame_charts.replay_line(gain, blamed_ms))
    st.plotly_chart(blame_charts.stall_timeline_figure(gaps), key="blame_timeline")
    st.dataframe(
        blame_charts.culprits_frame(blame["culprits"][:10]), hide_index=True, key="culprits"
    )

# ---- top offenders of the window --------------------------------------------------------------
st.subheader("Top offenders")
if ctx.engine_id is None or ctx.run_id is None or latest is None:
    st.info("Pick one engine in the sidebar to see which requests cost the others most.")
else:
    lo = (
        latest - blame_data.MAX_WINDOW_S
        if since is None
        else max(since, latest - blame_data.MAX_WINDOW_S)
    )
    try:
        offenders, by_class, excess = blame_data.window_blame(
            ctx.db_url, ctx.engine_id, ctx.run_id, lo, latest
        )
    except (data.StoreUnavailable, blame_data.BlameUnavailable) as exc:
        st.info(f"No ledger for this window: {exc}")
    else:
        st.caption(
            f"The last {latest - lo:.0f} s: {excess / 1e3:.1f} s of excess in all; caused by "
            f"{blame_charts.class_cost_line(by_class)}."
        )
        st.dataframe(blame_charts.offenders_frame(offenders), hide_index=True, key="offenders")
