"""Control: the engine's budget, policy and long-prefill cap, changed through the collector;
the history.

The Apply buttons act in callbacks, which Streamlit runs before the page script: the figures
(value in force, History) are read after the engine's answer, never before it."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import charts, control, data, ui
from dashboard.autopilot import SwitchSlo, latest_status
from dashboard.text import as_text
from storage.control import CollectorUnavailable
from wire.control import POLICIES

st.header("Control")
ctx = ui.context()
live, err = ui.collector_engines(ctx.collector_url)
connected = [e for e in (live or []) if e.get("connected")]

engine_ids = [str(e["engine_id"]) for e in connected]
if ctx.engine_id is not None and ctx.engine_id not in engine_ids:
    engine_ids.append(ctx.engine_id)
if not engine_ids:
    if live is None:
        st.warning(f"The collector is unreachable ({err}); control needs it. Stored data only.")
    else:
        st.info("No engine is connected to the collector, so there is nothing to control.")
    if ctx.empty:
        ui.empty_store_help(ctx)

    @st.fragment(run_every=2.0)
    def _wait_for_an_engine() -> None:
        """The page draws itself again as soon as an engine connects (one starting up)."""
        again, _ = ui.collector_engines(ctx.collector_url)
        if any(e.get("connected") for e in again or []):
            st.rerun()

    _wait_for_an_engine()
    st.stop()
default = engine_ids.index(ctx.engine_id) if ctx.engine_id in engine_ids else 0
engine_id = st.selectbox("Engine to control", engine_ids, index=default)
info = next((e for e in connected if e.get("engine_id") == engine_id), None)
if info is None and not ctx.empty:
    rows = ctx.engines[ctx.engines["engine_id"] == engine_id]
    info = rows.iloc[0].to_dict() if not rows.empty else None
info = info or {}
budget = info.get("token_budget")
max_budget = info.get("max_token_budget")
max_budget = (
    int(max_budget) if isinstance(max_budget, int | float) and max_budget == max_budget else None
)
policy = info.get("policy") or "chunked"
if live is None:
    st.warning(f"The collector is unreachable ({err}): changes cannot be sent now.")
elif info and not info.get("connected", True):
    st.warning("This engine is not connected to the collector: changes would be refused.")

HISTORY_WAIT_S = 3.0  # how long an answered change may take to reach the store's history


def _answered(res: control.ControlResult, eng: str, db_url: str | None) -> None:
    kind = "applied" if res.ok else "refused"
    st.session_state["control_answer"] = (kind, f"Engine {eng}: {res.describe()}")
    ui.collector_engines.clear()
    data.controls.clear()
    if res.ok:
        # The engine's control event reaches the store through the collector a moment after the
        # answer: wait for it (bounded), so History shows the change on this very rerun.
        deadline = time.monotonic() + HISTORY_WAIT_S
        step = res.applied_at_step
        while time.monotonic() < deadline:
            try:
                hist = data.controls(db_url, eng, None)
            except data.StoreUnavailable:
                break
            if not hist.empty and step is not None and (hist["applied_at_step"] == step).any():
                break
            time.sleep(0.1)
            data.controls.clear()


# The integer controls: the widget that holds the user's value and the check it must pass.
INT_CONTROLS = {
    "token_budget": ("budget_input", control.validate_budget),
    "long_prefill_token_threshold": ("cap_input", control.validate_cap),
}


def apply_int(key: str, eng: str, max_b: int | None, where: ui.Context) -> None:
    """The budget's or the cap's Apply: runs before the page is drawn (a button callback), so
    the figures below show the value in force and History the change as soon as the engine has
    answered."""
    widget, validate = INT_CONTROLS[key]
    try:
        n = validate(st.session_state.get(widget), max_b)
    except ValueError as exc:
        st.session_state["control_answer"] = ("refused", f"Not sent: {exc}")
        return
    try:
        res = control.set_scheduler(
            where.collector_url or "", eng, token=where.settings.control_token, **{key: n}
        )
    except (CollectorUnavailable, ValueError) as exc:
        st.session_state["control_answer"] = ("refused", f"Not applied: {exc}")
        ui.collector_engines.clear()
        return
    _answered(res, eng, where.db_url)


def apply_policy(eng: str, where: ui.Context) -> None:
    try:
        res = control.set_scheduler(
            where.collector_url or "",
            eng,
            policy=control.validate_policy(st.session_state.get("policy_input")),
            token=where.settings.control_token,
        )
    except (CollectorUnavailable, ValueError) as exc:
        st.session_state["control_answer"] = ("refused", f"Not applied: {exc}")
        ui.collector_engines.clear()
        return
    _answered(res, eng, where.db_url)


c1, c2, c3 = st.columns(3)
c1.metric("Token budget", budget if budget is not None else "—")
c2.metric("Max budget", max_budget if max_budget is not None else "—")
c3.metric("Policy", policy)

left, right = st.columns(2)
with left:
    st.number_input(
        "Token budget",
        value=int(budget) if isinstance(budget, int | float) and budget == budget else 512,
        step=64,
        key="budget_input",
        help=f"a whole number from 1 to {max_budget or 'the engine maximum'}",
    )
    st.button(
        "Apply budget",
        type="primary",
        on_click=apply_int,
        args=("token_budget", engine_id, max_budget, ctx),
    )
# Only the policies this engine honours (its hello's list; a vLLM engine has only "chunked").
policies = [p for p in POLICIES if p in (info.get("policies") or POLICIES)]
engine_kind = info.get("engine_kind")
with right:
    if len(policies) < 2:
        st.caption(
            f"Policy: {policy}, fixed"
            + (f" ({engine_kind} cannot change it while it runs)" if engine_kind else "")
            + ". The token budget and the long-prefill cap are the controls this engine supports."
        )
    else:
        st.radio(
            "Policy",
            policies,
            index=policies.index(policy) if policy in policies else 0,
            horizontal=True,
            key="policy_input",
        )
        st.button("Apply policy", on_click=apply_policy, args=(engine_id, ctx))

# The long-prefill cap: how many prefill tokens one request may take in a step while other
# prompts wait (0 = off). Older engines do not report it (None) and would refuse a change.
cap = info.get("long_prefill_token_threshold")
cap_known = isinstance(cap, int | float) and cap == cap
cap_col, cap_form = st.columns([1, 2])
cap_col.metric("Long-prefill cap", (int(cap) or "off") if cap_known else "—")
with cap_form:
    st.number_input(
        "Long-prefill cap (long_prefill_token_threshold; 0 = off)",
        value=int(cap) if cap_known else 0,
        min_value=0,
        step=64,
        key="cap_input",
        help="most prefill tokens one request may take in a step while other prompts wait for "
        "budget; budget nobody else can use still goes to it. A whole number from 0 to "
        f"{max_budget or 'the engine maximum'}",
    )
    st.button(
        "Apply cap",
        on_click=apply_int,
        args=("long_prefill_token_threshold", engine_id, max_budget, ctx),
    )


def switch_autopilot(eng: str, where: ui.Context) -> None:
    """The autopilot switch's callback: start the child with the SLOs typed, or stop it (it
    stores "autopilot off" and leaves the engine where it is)."""
    switch = ui.autopilot_switch(str(where.settings.data_dir))
    if not st.session_state.get(f"ap_on_{eng}"):
        switch.stop(eng)
        st.session_state["control_answer"] = ("applied", f"Autopilot off for {eng}")
        return
    tail = float(st.session_state.get("ap_tail") or 0.0)
    slo = SwitchSlo(
        float(st.session_state.get("ap_itl") or 0.0),
        float(st.session_state.get("ap_ttft") or 0.0),
        tail if tail > 0 else None,
    )
    if not where.collector_url or not where.db_url:
        st.session_state["control_answer"] = ("refused", "Not started: no collector to steer")
        st.session_state[f"ap_on_{eng}"] = False
        return
    try:
        switch.start(
            where.collector_url, eng, where.db_url, slo, token=where.settings.control_token
        )
    except (ValueError, RuntimeError, OSError) as exc:
        st.session_state["control_answer"] = ("refused", f"Autopilot not started: {exc}")
        st.session_state[f"ap_on_{eng}"] = False
        return
    st.session_state["control_answer"] = ("applied", f"Autopilot on for {eng}: {slo.label()}")


st.subheader("Autopilot")
switch = ui.autopilot_switch(str(ctx.settings.data_dir))
ap_state = switch.state(engine_id)
ap_slo = switch.slo(engine_id) or SwitchSlo(100.0, 2000.0)
s1, s2, s3 = st.columns(3)
s1.number_input("Chat ITL p99 SLO (ms)", min_value=1.0, value=ap_slo.itl_ms, key="ap_itl")
s2.number_input("TTFT p99 SLO (ms)", min_value=1.0, value=ap_slo.ttft_ms, key="ap_ttft")
s3.number_input(
    "ITL max SLO (ms, 0 = none)",
    min_value=0.0,
    value=ap_slo.tail_itl_ms or 0.0,
    key="ap_tail",
    help="an SLO on each request's longest gap: the stall tail that a p99 cannot see",
)
toggle_key = f"ap_on_{engine_id}"
st.session_state[toggle_key] = ap_state == "on"  # the switch shows the child's real state
st.toggle(
    "Autopilot: set the budget and cap to these SLOs",
    key=toggle_key,
    on_change=switch_autopilot,
    args=(engine_id, ctx),
    help="every 2 s it replays the last 20 s of traffic through the engine's own scheduler at "
    "each supported budget and cap, with the step-cost model fitted on the last 2 minutes, and "
    "moves to the setting with the most requests predicted to meet the SLOs. A manual change "
    "above pauses it; off leaves the engine where it is.",
)
try:
    ap_hist = data.controls(ctx.db_url, engine_id, None)
except data.StoreUnavailable:
    ap_hist = None
status = latest_status(ap_hist)
st.caption(
    f"Autopilot {ap_state}"
    + (" (a manual control won; switch it on again to resume)" if ap_state == "paused" else "")
    + (f" · last word: {status}" if status else "")
)

answer = st.session_state.get("control_answer")
if answer:
    kind, text = answer
    (st.success if kind == "applied" else st.error)(as_text(text))

st.subheader("History")
try:
    hist = data.controls(ctx.db_url, engine_id, None)
except data.StoreUnavailable as exc:
    hist = pd.DataFrame()
    st.warning(str(exc))
if hist.empty:
    st.caption("No changes yet.")
else:
    shown = hist.sort_values("time", ascending=False).copy()
    shown["time"] = charts.to_datetime(shown["time"]).dt.strftime("%H:%M:%S.%f").str[:-3]
    cols = [
        "time",
        "key",
        "old_value",
        "new_value",
        "accepted",
        "applied_at_step",
        "reason",
        "source",
    ]
    st.dataframe(shown[[c for c in cols if c in shown]], hide_index=True)
    latest = ctx.latest
    if ctx.run_id is not None and latest is not None:
        try:
            recent = data.steps(ctx.db_url, ctx.engine_id, ctx.run_id, since=latest - 60)
            fig = charts.step_tokens_figure(recent, hist)
            fig.update_layout(height=320, title="Budget and tokens per step, last 60 s")
            st.plotly_chart(fig, key="control_steps")
        except data.StoreUnavailable:
            pass
