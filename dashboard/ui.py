"""Pieces every page shares: settings, the process-wide stack and launcher, the collector's
state, the engine selection (sidebar), and the messages for an empty or unreadable store."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from dashboard import control, data, health
from dashboard.autopilot import AutopilotSwitch
from dashboard.processes import yield_cpu
from dashboard.services import (
    DEFAULT_DURATION_S,
    PROFILES,
    SERVED_WINDOW_S,
    Stack,
    TrafficLauncher,
    launcher_shapes,
    overload_message,
)
from dashboard.settings import Settings, parse_settings
from dashboard.text import as_text
from loadgen.profiles import MAX_CHAT_USERS
from loadgen.saturation import MIN_ELAPSED_S
from storage.control import CollectorUnavailable

logger = logging.getLogger(__name__)

ALL = "All engines"
CONTEXT_KEY = "chunkscope_context"


def served() -> bool:
    """True under ``streamlit run dashboard`` (False under AppTest)."""
    return Path(sys.argv[0]).name == "streamlit_app.py"


def script_args() -> list[str]:
    """Flags after ``--`` of ``streamlit run dashboard -- ...`` (none under AppTest)."""
    return sys.argv[1:] if served() else []


@st.cache_resource(show_spinner=False)
def _settings(argv: tuple[str, ...], env_key: tuple[tuple[str, str], ...]) -> Settings:
    return parse_settings(list(argv))


def settings() -> Settings:
    """This server's settings (keyed on the flags and ``CHUNKSCOPE_*`` variables)."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("CHUNKSCOPE_")))
    return _settings(tuple(script_args()), env)


@st.cache_resource(show_spinner=False)
def stack(_settings: Settings, key: str) -> Stack:
    """One per server process (and settings): the embedded children start here, once."""
    return Stack(_settings).start()


@st.cache_resource(show_spinner=False)
def launcher(data_dir: str) -> TrafficLauncher:
    return TrafficLauncher(Path(data_dir))


@st.cache_resource(show_spinner=False)
def autopilot_switch(data_dir: str) -> AutopilotSwitch:
    """The autopilot children (one per engine id), shared by every browser session."""
    return AutopilotSwitch(Path(data_dir))


@st.cache_data(ttl=2.0, show_spinner=False)
def collector_engines(url: str | None) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The collector's ``list_engines`` answer, or None and why it is unavailable."""
    if not url:
        return None, "no collector configured"
    try:
        return control.list_engines(url, token=settings().control_token), None
    except CollectorUnavailable as exc:
        return None, str(exc)


# The collector's /healthz turns 503 within 2 s of a store that stops answering; polled at most
# this often (shared by every fragment and session), the dashboard says so within 2.5 s more
# (the Live page redraws every 2 s): under 5 s from the outage to the banner
HEALTH_TTL_S = 0.5


@st.cache_data(ttl=HEALTH_TTL_S, show_spinner=False)
def collector_health(url: str | None) -> health.CollectorHealth | None:
    """The collector's ``/healthz`` answer (None: no collector configured)."""
    return health.check(url) if url else None


def store_outage_banner(collector_url: str | None) -> bool:
    """Say so when the collector answers that its store is failing or hung; True when it did."""
    h = collector_health(collector_url)
    if h is None or not h.store_outage:
        return False
    st.error(
        f"Store outage: the collector cannot write to its store ({as_text(h.detail)}). "
        "Engines keep their events and resend them once it is back: the charts stop at the "
        "last stored step until then."
    )
    return True


@dataclass(frozen=True)
class Context:
    """What a page needs: where the data is, and which engine(s) the sidebar selected."""

    settings: Settings
    stack: Stack
    engines: pd.DataFrame
    store_error: str | None
    engine_id: str | None
    run_id: str | None
    runs: tuple[tuple[str, str], ...]
    label: str

    @property
    def db_url(self) -> str | None:
        return self.stack.db_url

    @property
    def collector_url(self) -> str | None:
        return self.stack.collector_url

    @property
    def empty(self) -> bool:
        return self.engines.empty

    def selected_rows(self) -> pd.DataFrame:
        if self.engines.empty:
            return self.engines
        keys = list(zip(self.engines["engine_id"], self.engines["run_id"], strict=True))
        mask = [k in set(self.runs) for k in keys]
        return self.engines[mask]

    @property
    def latest(self) -> float | None:
        rows = self.selected_rows()
        if rows.empty:
            return None
        v = pd.to_numeric(rows["last_time"], errors="coerce").max()
        return None if v is None or math.isnan(v) else float(v)

    @property
    def run(self) -> dict[str, Any] | None:
        """The selected run's engines row (None when 'All engines' is selected)."""
        if self.run_id is None:
            return None
        rows = self.selected_rows()
        return None if rows.empty else rows.iloc[0].to_dict()


def run_label(row: dict[str, Any]) -> str:
    state = "live" if row.get("connected") else "ended"
    return f"{row['engine_id']} · {str(row['run_id'])[:12]} ({row.get('model')}, {state})"


def build_context(selection: str | None = None) -> Context:
    """Settings, stack and store state, and the run the sidebar picked (newest by default)."""
    s = settings()
    stk = stack(s, repr(s))
    store_error = None
    try:
        eng = data.engines(stk.db_url)
    except data.StoreUnavailable as exc:
        eng, store_error = pd.DataFrame(), str(exc)
    if eng.empty:
        return Context(s, stk, eng, store_error, None, None, (), "no engines yet")
    rows = eng.to_dict("records")
    labels = [run_label(r) for r in rows]
    choice = selection if selection in ([ALL, *labels]) else labels[0]
    if choice == ALL:
        newest = pd.to_numeric(eng["last_time"], errors="coerce").max()
        recent = [
            (r["engine_id"], r["run_id"])
            for r in rows
            if r.get("connected")
            or (isinstance(r.get("last_time"), float) and r["last_time"] >= newest - 600)
        ]
        return Context(s, stk, eng, store_error, None, None, tuple(recent), ALL)
    r = rows[labels.index(choice)]
    return Context(
        s,
        stk,
        eng,
        store_error,
        r["engine_id"],
        r["run_id"],
        ((r["engine_id"], r["run_id"]),),
        choice,
    )


def context() -> Context:
    """The context of this script run (made by the main script's sidebar; rebuilt in fragments)."""
    ctx = st.session_state.get(CONTEXT_KEY)
    if isinstance(ctx, Context):
        return ctx
    return build_context(st.session_state.get("engine_choice"))


def fresh_context() -> Context:
    """A fresh context for a fragment rerun: the store's newest times move every second."""
    return build_context(st.session_state.get("engine_choice"))


SIDEBAR_REFRESH_S = 2.0


def sidebar() -> Context:
    """The sidebar: process and collector state, the engine picker and the traffic launcher,
    each a fragment refreshed every couple of seconds (so the state shown follows the children
    starting or dying without a click). Returns this run's context for the page."""
    st.sidebar.title("chunkscope")
    with st.sidebar:
        _status_panel()
        _traffic_panel()
    ctx = build_context(st.session_state.get("engine_choice"))
    st.session_state[CONTEXT_KEY] = ctx
    return ctx


def _engine_changed() -> None:
    st.session_state["engine_choice_changed"] = True


def store_size_line(db_url: str | None) -> str:
    """The sidebar's store line: its size as the retention limits count it, and on disk."""
    from storage.retention import human_bytes

    try:
        used, on_disk = data.store_size(db_url)
    except data.StoreUnavailable as exc:
        return f"Store size: unknown ({exc})"
    line = f"Store size: {human_bytes(used)} in use"
    if on_disk != used:
        line += f", {human_bytes(on_disk)} on disk"
    return line + " (`chunkscope prune` deletes old runs)"


@st.fragment(run_every=SIDEBAR_REFRESH_S)
def _status_panel() -> None:
    if st.session_state.pop("engine_choice_changed", False):
        st.rerun()  # the whole page follows the new selection
    ctx = build_context(st.session_state.get("engine_choice"))
    stk = ctx.stack
    if stk.embedded:
        st.caption(
            "Embedded: collector and engine started by the dashboard "
            f"(data in {ctx.settings.data_dir})"
        )
        if stk.starting:
            st.info("Starting the collector and the engine…")
        for row in stk.describe():
            st.markdown(
                f"**{row['process']}** · {row['state']} · pid {row['pid']}  \n`{row['address']}`"
            )
        if stk.error:
            st.error("Embedded stack: " + as_text(stk.error.splitlines()[0]))
            with st.expander("log"):
                st.code(stk.error[-3000:])
        if not stk.starting and any(not c.alive() for c in stk.children()):
            if st.button("Restart stopped processes"):
                stk.restart()
    else:
        store = data.shown_url(ctx.db_url)
        st.caption(f"Attached: collector {ctx.collector_url or '—'} · store {store}")
    store_outage_banner(ctx.collector_url)
    live, err = collector_engines(ctx.collector_url)
    if live is not None:
        n = sum(1 for e in live if e.get("connected"))
        st.success(f"Collector up: {n} engine(s) connected")
    elif stk.starting and not ctx.collector_url:
        st.info("Collector starting…")
    elif ctx.collector_url:
        st.warning(f"Collector unreachable ({err}). Showing stored data.")
    if ctx.store_error and stk.embedded and stk.starting:
        st.info("Store: not created yet (the collector creates it as it starts)")
    elif ctx.store_error:
        st.warning(f"Store: {ctx.store_error}")
    else:
        st.caption(store_size_line(ctx.db_url))
    if not ctx.empty:
        labels = [run_label(r) for r in ctx.engines.to_dict("records")]
        options = [*labels, ALL]
        current = st.session_state.get("engine_choice")
        if current not in options:
            st.session_state.pop("engine_choice", None)
        st.selectbox("Engine", options, key="engine_choice", on_change=_engine_changed)


@st.fragment(run_every=SIDEBAR_REFRESH_S)
def _traffic_panel() -> None:
    yield_cpu()
    s = settings()
    stk = stack(s, repr(s))
    lch = launcher(str(s.data_dir))
    st.subheader("Traffic")
    if stk.embedded:
        url = stk.engine_url
        st.caption(f"Engine: {url or 'starting…'}")
    else:
        url = st.text_input(
            "Engine URL", value=s.engine_url or "http://127.0.0.1:8000", key="traffic_url"
        )
    profile = st.selectbox("Profile", list(PROFILES), key="traffic_profile")
    # Each profile has its own fields (keys name it), drawn with its preset or with the value
    # last typed into them. One field for all profiles, reloaded with a preset on a profile
    # change, loses that change whenever a timed redraw leaves the browser before it arrives:
    # the browser sends the old value back. A typed value is kept outside the widget's state:
    # Streamlit drops the state of a widget that a full run did not draw (the other profile's),
    # so without it a value came back or not depending on which redraws ran in between.
    rate_key, users_key = f"traffic_rate_{profile}", f"traffic_users_{profile}"
    st.number_input(
        "Rate (req/s)",
        min_value=0.01,
        max_value=100.0,
        value=float(_kept(rate_key, PROFILES[profile].rate)),
        step=0.1,
        key=rate_key,
        on_change=_keep,
        args=(rate_key,),
    )
    st.number_input(
        "Chat users",
        min_value=0,
        max_value=MAX_CHAT_USERS,
        value=int(_kept(users_key, PROFILES[profile].users)),
        step=1,
        key=users_key,
        on_change=_keep,
        args=(users_key,),
        help="chat users beside the profile's requests, each sending its next turn a moment "
        "after its answer ends: about this many chat streams are in flight whenever a long "
        "prompt or image arrives (the streams it stalls; 0 = none)",
    )
    st.number_input(
        "Duration (s)",
        min_value=1.0,
        max_value=3600.0,
        value=DEFAULT_DURATION_S,
        step=10.0,
        key="traffic_duration",
    )
    shapes = launcher_shapes(s.model if stk.embedded else None)
    st.caption(
        f"Shapes: `{shapes}`"
        + (" (sized for the demo engine)" if shapes == "demo" else " (from the server's model)")
    )
    c1, c2 = st.columns(2)
    # callbacks, not `if st.button(...)`: a click is acted on before the rerun it triggers,
    # with the values the widgets hold then, even when a periodic redraw of this panel or of
    # the page is in flight at the moment of the click
    start = {
        "lch": lch, "url": url or "", "shapes": shapes,
        "api_key": s.api_key or os.environ.get("OPENAI_API_KEY"),
    }  # fmt: skip
    c1.button(
        "Start traffic", disabled=lch.running or not url, on_click=_start_traffic, kwargs=start
    )
    c2.button("Stop traffic", disabled=not lch.running, on_click=lch.stop)
    problem = st.session_state.pop("traffic_error", None)
    if problem:
        st.error(problem)
    st.caption(f"Load: {lch.state()}")
    if lch.running:
        _served_load(stk, lch)


_KEPT = "traffic_kept"


def _kept(key: str, preset: float) -> float:
    """The value last typed into the traffic field `key`, or the profile's preset."""
    kept = st.session_state.get(_KEPT) or {}
    return float(kept.get(key, preset))


def _keep(key: str) -> None:
    """A traffic field's change: its value kept for when the field is drawn again."""
    kept = dict(st.session_state.get(_KEPT) or {})
    value = st.session_state.get(key)
    if value is not None:
        kept[key] = value
    st.session_state[_KEPT] = kept


def _start_traffic(lch: TrafficLauncher, url: str, shapes: str, api_key: str | None) -> None:
    """The Start button: the launcher with the values the sidebar's widgets hold now."""
    state = st.session_state
    profile = str(state.get("traffic_profile") or next(iter(PROFILES)))
    preset = PROFILES[profile]
    try:
        lch.start(
            url,
            profile,
            rate=float(state.get(f"traffic_rate_{profile}", preset.rate)),
            duration=float(state.get("traffic_duration", DEFAULT_DURATION_S)),
            seed=int(time.time()) % 10_000,
            users=int(state.get(f"traffic_users_{profile}", preset.users)),
            shapes=shapes,
            api_key=api_key,
        )
    except (ValueError, RuntimeError, OSError) as exc:
        state["traffic_error"] = str(exc)


def _served_load(stk: Stack, lch: TrafficLauncher) -> None:
    """What the engine finished over the last minute of the run (from the store), and a warning
    when the launcher offers more than that."""
    if lch.started_at is None:
        return
    now = time.time()
    elapsed = now - lch.started_at
    if elapsed < MIN_ELAPSED_S:
        return
    window = min(SERVED_WINDOW_S, elapsed)
    since = 5.0 * ((now - window) // 5.0)  # a 5 s grid: the cached answer is reused
    try:
        summary = data.latency_summary(stk.db_url, None, None, since, None)
    except data.StoreUnavailable:
        return
    rows = summary[summary["traffic_class"] == "all"] if not summary.empty else summary
    finished = float(rows["num_requests"].iloc[0]) if not rows.empty else 0.0
    span = now - since
    st.caption(f"Engine finished {finished / span:.2f} req/s over the last {span:.0f} s")
    text = overload_message(lch.offered_rps, finished, span)
    if text:
        st.warning(text)


def empty_store_help(ctx: Context) -> None:
    """What to run when nothing has reported yet (never an exception)."""
    if ctx.store_error:
        st.warning(f"The store cannot be read yet: {ctx.store_error}")
    if ctx.stack.embedded:
        if ctx.stack.starting:
            st.info("The collector and the engine are starting; the first steps appear here soon.")
        else:
            st.info(
                "No engine has reported yet. Start traffic from the sidebar (profile `mixed`), "
                "then watch the Live page."
            )
    else:
        st.info(
            "No engine has reported to this store yet. Start one that publishes to the "
            "collector, then some traffic:\n\n"
            "```\npython -m engine --model demo --collector-url "
            f"{ctx.collector_url or 'ws://HOST:PORT'}\n"
            "python -m loadgen --url http://127.0.0.1:8000 --profile mixed --rate 1 "
            "--duration 120\n```"
        )


def span_notes(
    runs: list[dict[str, Any]], lo: float, hi: float, fmt: Any = None, slack_s: float = 5.0
) -> list[str]:
    """What a shared window [lo, hi] leaves out of each run: a run that started inside it (it
    saw only part of the window's traffic) or went on after it (its later traffic is not
    compared). Wall seconds; ``fmt`` turns one into text (default: seconds as they are)."""
    fmt = fmt or (lambda t: f"{t:.0f}")
    notes = []
    for r in runs:
        started = pd.to_numeric(r.get("started"), errors="coerce")
        last = pd.to_numeric(r.get("last_time"), errors="coerce")
        if pd.notna(started) and started > lo + slack_s:
            notes.append(f"{r['engine_id']} started {started - lo:.0f} s into the window")
        if pd.notna(last) and last > hi + slack_s:
            notes.append(f"{r['engine_id']} ran on until {fmt(last)} ({last - hi:.0f} s after it)")
    return notes
