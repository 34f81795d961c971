"""Fleet: every engine of the store, the collector it is connected to, its budget and cap, and
its last minute (step rate, stalls, worst chat inter-token gap), worst first; one click opens
an engine's Live page (and selects it for Control, which steers it through any collector of
the fleet)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import data, ui

LIVE_PAGE = "views/live.py"
OPEN_KEY = "fleet_open"


def _open(label: str) -> None:
    """A button's callback (before any widget of the rerun): select the engine's newest run in
    the sidebar, and go to Live."""
    st.session_state["engine_choice"] = label
    st.session_state[OPEN_KEY] = True


if st.session_state.pop(OPEN_KEY, False):
    st.switch_page(LIVE_PAGE)

st.header("Fleet")
ctx = ui.context()
if ctx.empty:
    ui.empty_store_help(ctx)
    st.stop()
try:
    table = data.fleet(ctx.db_url)
except data.StoreUnavailable as exc:
    st.warning(str(exc))
    st.stop()

if table["collector"].isna().all() and ctx.collector_url:
    # one collector writes this store: the connected engines are on it
    table.loc[table["connected"], "collector"] = ctx.collector_url
n_live = int(table["connected"].sum())
collectors = table.loc[table["connected"], "collector"].dropna().nunique()
st.caption(
    f"{len(table)} engine(s), {n_live} connected through {collectors} collector(s). Each "
    "engine's last minute of steps; worst chat inter-token gap first. Open one to watch it; "
    "Control steers it through any collector."
)

shown = pd.DataFrame(
    {
        "engine": table["engine_id"],
        "state": ["connected" if c else "away" for c in table["connected"]],
        "collector": table["collector"].fillna("—"),
        "model": table["model"],
        "budget": table["token_budget"],
        "max budget": table["max_token_budget"],
        "cap": table["long_prefill_token_threshold"],
        "steps/s": table["steps_per_s"].round(1),
        "stalls": table["stalls"],
        "worst chat ITL ms": pd.to_numeric(table["worst_chat_itl_ms"], errors="coerce").round(1),
    }
)
st.dataframe(shown, hide_index=True, width="stretch")

labels = {(r["engine_id"], r["run_id"]): ui.run_label(r) for r in ctx.engines.to_dict("records")}
st.markdown("**Open on the Live page**")
cols = st.columns(4)
for i, row in enumerate(table.to_dict("records")):
    label = labels.get((row["engine_id"], row["run_id"]))
    if label is None:
        continue
    cols[i % 4].button(
        str(row["engine_id"]),
        key=f"fleet-open-{row['engine_id']}",
        on_click=_open,
        args=(label,),
        width="stretch",
    )
