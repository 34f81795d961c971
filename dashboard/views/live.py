"""Live: the last minute of steps and streamed tokens, redrawn every two seconds."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import blame_data, charts, data, story, ui
from dashboard.autopilot import autopilot_events, latest_status
from dashboard.live import SUMMARY_GRID_S, LiveWindow, RefreshPace, coarsen_steps
from dashboard.live_blame import StallBlame, stall_choices
from dashboard.processes import yield_cpu

REFRESH_S = 2.0
SUMMARY_REFRESH_S = 5.0
ITL_POINTS = 1500  # drawn at most; every stall is always drawn
REQUESTS_PAGE = "views/requests.py"
FOCUS_KEY = "requests_focus"  # the request the Requests page opens on

st.header("Live")
c1, c2, c3 = st.columns(3)
window_s = c1.select_slider("Window (s)", options=[15, 30, 60, 120, 300], value=60)
factor = c2.number_input("Stall: ITL above x median", min_value=1.1, value=3.0, step=0.5)
floor = c3.number_input("and above (ms)", min_value=0.0, value=100.0, step=10.0)


held = st.session_state.get("live_pace")
pace: RefreshPace = held if isinstance(held, RefreshPace) else RefreshPace(base_s=REFRESH_S)
st.session_state["live_pace"] = pace


def live_view() -> None:
    """One redraw, timed: a redraw slower than its interval slows the page (``RefreshPace``);
    the fragment's interval is fixed when the page runs, so a change reruns the page."""
    yield_cpu()
    t0 = time.perf_counter()
    _live_view()
    if pace.observe(time.perf_counter() - t0):
        st.rerun(scope="app")


def _live_view() -> None:
    ctx = ui.fresh_context()
    ui.store_outage_banner(ctx.collector_url)
    if ctx.empty:
        ui.empty_store_help(ctx)
        return
    lw = st.session_state.get("live_window")
    if (
        not isinstance(lw, LiveWindow)
        or not lw.matches(ctx.engine_id, ctx.runs)
        or (lw.window_s != window_s)
    ):
        lw = LiveWindow(engine_id=ctx.engine_id, run_ids=ctx.runs, window_s=float(window_s))
        st.session_state["live_window"] = lw
    problem = None
    try:
        lw.refresh(data.queries(), data.connection(ctx.db_url), latest=ctx.latest)
    except data.StoreUnavailable as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - a read failed: keep showing what we hold
        problem = f"cannot read the store: {exc}"
    _status(ctx, lw, problem)
    win = lw.window()
    since = None if win is None else SUMMARY_GRID_S * (win[0] // SUMMARY_GRID_S)
    try:
        ctrl = data.controls(ctx.db_url, ctx.engine_id, ctx.run_id, since, None)
    except data.StoreUnavailable:
        ctrl = None
    steps = coarsen_steps(lw.steps)  # what a redraw ships stays bounded at any step rate
    fig = charts.step_tokens_figure(steps, ctrl)
    fig.update_layout(uirevision="live-steps", height=360)
    st.plotly_chart(fig, key="live_steps")
    stalls, blame = _blame_stalls(ctx, lw.itl)
    notes = None
    if stalls is not None:
        notes = pd.Series([blame.note(r) for r in stalls.itertuples()], index=stalls.index)
    fig = charts.itl_figure(
        lw.itl,
        ctrl,
        factor=float(factor),
        floor_ms=float(floor),
        max_points=ITL_POINTS,
        stall_notes=notes,
    )
    fig.update_layout(uirevision="live-itl", height=360)
    st.plotly_chart(fig, key="live_itl")
    if stalls is not None:
        _stall_picker(stalls, blame)
    ap = autopilot_events(ctrl)
    if not ap.empty:
        st.caption(f"Autopilot · {latest_status(ctrl)}")
        try:
            reqs = data.requests(ctx.db_url, ctx.engine_id, ctx.run_id, since, None)
        except data.StoreUnavailable:
            reqs = None
        fig = charts.autopilot_figure(ap, lw.itl, reqs)
        fig.update_layout(uirevision="live-autopilot")
        st.plotly_chart(fig, key="live_autopilot")
    fig = charts.kv_queue_figure(steps, ctrl)
    fig.update_layout(uirevision="live-kv", height=380)
    st.plotly_chart(fig, key="live_kv")


def _blame_stalls(
    ctx: ui.Context, itl: pd.DataFrame | None
) -> tuple[pd.DataFrame | None, StallBlame]:
    """The ringed tokens, and who caused each: the ledger of the gaps before them, read only
    for stalls not blamed at an earlier redraw (``StallBlame``, kept in the session)."""
    held = st.session_state.get("live_stall_blame")
    blame = held if isinstance(held, StallBlame) else StallBlame()
    st.session_state["live_stall_blame"] = blame
    if itl is None or itl.empty:
        return None, blame
    stalls = itl[charts.stall_mask(itl, factor=float(factor), floor_ms=float(floor))]
    if stalls.empty:
        return None, blame
    blame.update(
        stalls, lambda eid, rid, tokens: blame_data.live_stall_blame(ctx.db_url, eid, rid, tokens)
    )
    return stalls, blame


def _stall_picker(stalls: pd.DataFrame, blame: StallBlame) -> None:
    """A stall, picked by time, request and culprit, opens the Requests page on the stalled
    request or on its culprit."""
    choices = stall_choices(stalls, blame)
    if not choices:
        return
    c1, c2, c3 = st.columns([4, 1, 1], vertical_alignment="bottom")
    pick = c1.selectbox("Who caused a stall (newest first)", list(choices), key="live_stall_pick")
    if pick is None:
        return
    victim, culprit = choices[pick]
    target = None
    if c2.button("Open the victim", key="live_open_victim", width="stretch"):
        target = victim
    if c3.button("Open the culprit", key="live_open_culprit", width="stretch"):
        target = culprit
    if target is not None:
        st.session_state[FOCUS_KEY] = target
        st.switch_page(REQUESTS_PAGE)


@st.fragment(run_every=SUMMARY_REFRESH_S)
def change_view() -> None:
    """The newest accepted budget change, and the stalls either side of it (the windows of the
    Compare page, at most the Live window each side): how many, and how tall the worst."""
    yield_cpu()
    ctx = ui.fresh_context()
    if ctx.empty or ctx.run is None or not ctx.engine_id or not ctx.run_id:
        return
    latest = ctx.latest
    try:
        ctrl = data.controls(ctx.db_url, ctx.engine_id, ctx.run_id)
    except data.StoreUnavailable:
        return
    marks = charts.control_marker_times(ctrl)
    if marks.empty or latest is None:
        return
    marks = marks[marks["accepted"] & marks["label"].str.startswith("budget")]
    if marks.empty:
        return
    last = marks.sort_values("x").iloc[-1]
    t = float(last["x"])
    if latest - t > 3 * float(window_s):
        return  # an old change: the Compare page holds it
    # the right edge moves in whole grid steps from the change: the cached reads are reused
    # between refreshes
    span = min(latest - t, float(window_s))
    edge = t + (SUMMARY_GRID_S * (span // SUMMARY_GRID_S) if span > SUMMARY_GRID_S else span)
    first = pd.to_numeric(ctx.run.get("started"), errors="coerce")
    win = story.change_windows(
        t,
        [float(x) for x in marks["x"] if float(x) != t],
        first=None if pd.isna(first) else float(first),
        latest=edge,
        max_s=float(window_s),
    )
    if win.after is None:
        st.caption(f"**{last['label']}** at {charts.to_datetime([t]).iloc[0]:%H:%M:%S}: waiting "
                   "for steps after it.")  # fmt: skip
        return
    try:
        before, after = (
            data.stall_window(ctx.db_url, ctx.engine_id, ctx.run_id, lo, hi, "chat")
            for lo, hi in (win.before, win.after)
        )
    except data.StoreUnavailable:
        return
    st.markdown(story.change_line(str(last["label"]), t, before, after))


@st.fragment(run_every=SUMMARY_REFRESH_S)
def latency_view() -> None:
    """TTFT / TPOT percentiles by class over the window: a heavier query, so its own, slower
    fragment (the timeline above keeps its own pace)."""
    yield_cpu()
    ctx = ui.fresh_context()
    latest = ctx.latest
    if ctx.empty or latest is None:
        return
    since = SUMMARY_GRID_S * ((latest - window_s) // SUMMARY_GRID_S)
    try:
        summary = data.latency_summary(ctx.db_url, ctx.engine_id, ctx.run_id, since, None)
    except data.StoreUnavailable as exc:
        st.warning(str(exc))
        return
    left, right = st.columns([3, 2])
    with left:
        fig = charts.latency_figure(summary)
        fig.update_layout(height=320)
        st.plotly_chart(fig, key="live_latency")
    with right:
        if not summary.empty:
            st.dataframe(summary.round(1), hide_index=True)


def _status(ctx: ui.Context, lw: LiveWindow, problem: str | None) -> None:
    row = ctx.run
    parts = [f"**{ctx.label}**"]
    if row is not None:
        parts.append(f"budget {row.get('token_budget')} · policy {row.get('policy')}")
        last = row.get("last_step")
        parts.append("no steps yet" if last is None else f"last step {last}")
        if not row.get("connected"):
            ended = "without goodbye" if row.get("ended_without_goodbye") else "normally"
            parts.append(f"engine disconnected ({ended}): showing stored data")
    horizon = lw.horizon
    if horizon is not None:
        parts.append(f"newest step {time.time() - horizon:.1f} s ago")
    if pace.slowed and pace.last_redraw_s is not None:
        parts.append(
            f"redrawn every {pace.interval_s:g} s (a redraw took {pace.last_redraw_s:.1f} s)"
        )
    st.caption(" · ".join(parts))
    lost = ctx.selected_rows()["num_gap_events"].fillna(0).sum() if not ctx.empty else 0
    if lost:
        st.warning(
            f"The engine declared {int(lost)} telemetry gap(s): it could not keep some events, "
            "so steps or tokens are missing from these charts."
        )
    if problem:
        st.warning(f"{problem} — showing the data already read; retrying at each redraw.")
    live, err = ui.collector_engines(ctx.collector_url)
    if live is None and ctx.collector_url:
        st.warning(f"Collector unreachable ({err}): showing stored data.")


change_view()
st.fragment(run_every=pace.interval_s)(live_view)()
latency_view()
