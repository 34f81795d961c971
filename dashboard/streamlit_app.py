"""``streamlit run dashboard``: watch the engine step by step and steer its token budget.

Without flags it starts its own collector and engine (the embedded default); with
``-- --collector ws://HOST:PORT --db URL`` it attaches to running ones (see dashboard/settings.py).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import ui
from dashboard.processes import yield_cpu
from dashboard.settings import bind_refusal

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="chunkscope", layout="wide")
yield_cpu()

try:
    settings = ui.settings()
except ValueError as exc:
    st.error(f"Bad dashboard settings: {exc}")
    st.stop()

if ui.served():  # a real `streamlit run` (AppTest has no address to check)
    refusal = bind_refusal(st.get_option("server.address"), settings)
    if refusal:
        st.error(f"Not serving: {refusal}")
        st.stop()

ui.sidebar()

pages = [
    st.Page(HERE / "views" / "live.py", title="Live", default=True),
    st.Page(HERE / "views" / "fleet.py", title="Fleet"),
    st.Page(HERE / "views" / "step.py", title="Step"),
    st.Page(HERE / "views" / "requests.py", title="Requests"),
    st.Page(HERE / "views" / "control.py", title="Control"),
    st.Page(HERE / "views" / "compare.py", title="Compare"),
    st.Page(HERE / "views" / "sweep.py", title="Sweep"),
]
st.navigation(pages, position="top").run()
