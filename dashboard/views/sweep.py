"""Sweep: which token budget to run. The Pareto front of TTFT p99 against ITL p99 per budget,
measured (a ``python -m loadgen sweep --out`` document) and predicted (from the store by the
advisor, or a ``python -m advisor predict --out`` document), the SLO lines, the recommendation
with its reason, and a button that applies it through the collector."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import streamlit as st

from advisor import overload
from advisor.recommend import Slo, recommend_from
from dashboard import control, data, sweep_charts, ui
from dashboard.text import as_text
from storage.control import CollectorUnavailable

DEFAULT_BUDGETS = "128,256,512,1024,2048,8192"

st.header("Sweep")
ctx = ui.context()
sweep_dir = Path(ctx.settings.data_dir) / "sweeps"
st.caption(
    "Measure: `python -m loadgen sweep --url ... --budgets 128,256,512,1024,2048,8192 "
    f"--out {sweep_dir}/NAME.json` (the budget is changed live, window by window). "
    "Predict: from the traffic and steps in the store, below."
)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        st.error(f"Cannot read {path.name}: {exc}")
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("windows"), list):
        st.error(f"{path.name} is not a sweep or prediction document (no 'windows' list)")
        return None
    return doc


files = sorted(sweep_dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
choice = st.selectbox(
    "Sweep or prediction document",
    ["(none)", *[p.name for p in files]],
    index=1 if files else 0,
    key="sweep_file",
    help=f"JSON files in {sweep_dir}",
)
doc = _load(sweep_dir / choice) if choice != "(none)" else None

c1, c2, c5, c3, c4 = st.columns(5)
slo_itl = c1.number_input(
    "ITL p99 SLO (ms, 0 = none)",
    min_value=0.0,
    value=float((doc or {}).get("slo", {}).get("itl_p99_ms") or 100.0),
    key="sweep_slo_itl",
)
slo_ttft = c2.number_input(
    "TTFT p99 SLO (ms, 0 = none)",
    min_value=0.0,
    value=float((doc or {}).get("slo", {}).get("ttft_p99_ms") or 0.0),
    key="sweep_slo_ttft",
)
slo_itl_max = c5.number_input(
    "ITL max SLO (ms, 0 = none)",
    min_value=0.0,
    value=float((doc or {}).get("slo", {}).get("itl_max_ms") or 0.0),
    key="sweep_slo_itl_max",
    help="the longest gap between two tokens: a stall that the p99 cannot see",
)
budgets_text = c3.text_input("Budgets to predict", DEFAULT_BUDGETS, key="sweep_budgets")
minutes = c4.number_input(
    "Predict from the last (min)",
    min_value=0.5,
    value=5.0,
    step=1.0,
    key="sweep_minutes",
    help="the traffic and steps of the selected run's last minutes",
)
slo = Slo(slo_itl or None, slo_ttft or None, slo_itl_max or None)

measured, predicted = sweep_charts.split_windows(doc)
if st.button("Predict from the store", disabled=ctx.empty or ctx.db_url is None):
    try:
        budgets = [int(b) for b in budgets_text.split(",") if b.strip()]
        from advisor.predict import predict_from_store

        with st.spinner("Fitting the step cost model and simulating each budget..."):
            latest = ctx.latest
            st.session_state["sweep_prediction"] = predict_from_store(
                ctx.db_url or "",
                budgets,
                engine_id=ctx.engine_id,
                run_id=ctx.run_id,
                since=None if latest is None else latest - 60.0 * minutes,
                until=latest,
                slo=slo,
            )
    except ValueError as exc:  # FitError included: too few steps, no traffic
        st.session_state["sweep_prediction"] = None
        st.error(f"No prediction: {exc}")
live_prediction = st.session_state.get("sweep_prediction")
if live_prediction:
    predicted = list(live_prediction["windows"])
    fit = live_prediction["fit"]
    st.caption(
        f"Predicted from the store: cost model fitted on {fit['num_steps']} steps "
        f"({fit.get('num_outliers', 0)} outliers left out), relative error p50 "
        f"{100 * fit['model']['rel_err_p50']:.0f}% / p95 {100 * fit['model']['rel_err_p95']:.0f}%."
    )

rec = recommend_from(measured or None, predicted or None, slo)
seen = (live_prediction or doc or {}).get("observed_window") or {}
if seen.get("overloaded"):
    st.error(
        f"The observed window was overloaded ({seen.get('overload_reason')}): its traffic is not "
        "what was offered, so nothing is recommended from it."
    )
for what, rows in (("Measured", measured), ("Predicted", predicted)):
    note = overload.describe(rows)
    if note:
        st.error(f"{what}: {note}. Their figures grow with the window's length, not the setting.")
if rec.budget is not None:
    what = f"**{rec.budget}**" + (
        f" with cap **{rec.cap or 'off'}**" if rec.cap is not None else ""
    )
    st.success(f"Recommended token budget: {what} — {rec.reason}")
elif measured or predicted:
    st.warning(rec.reason)
else:
    st.info("No sweep or prediction yet: run a sweep, or predict from the store.")

fig = sweep_charts.pareto_figure(
    measured,
    predicted,
    slo_itl_ms=slo.itl_ms,
    slo_ttft_ms=slo.ttft_ms,
    recommended_budget=rec.chosen,
    recommendation_source=rec.source,
    recommended_cap=rec.chosen_cap,
)
st.plotly_chart(fig, key="sweep_pareto")
if measured or predicted:
    st.dataframe(sweep_charts.sweep_table(measured, predicted).round(1), hide_index=True)

engine_id = ctx.engine_id
if rec.chosen is not None and engine_id is not None:
    label = f"Apply budget {rec.chosen} to {engine_id}"
    if rec.chosen_cap is not None:
        label = f"Apply budget {rec.chosen} with cap {rec.chosen_cap or 'off'} to {engine_id}"
    if st.button(label, type="primary", key="sweep_apply"):
        try:
            res = control.set_scheduler(
                ctx.collector_url or "",
                engine_id,
                token_budget=int(rec.chosen),
                long_prefill_token_threshold=rec.chosen_cap,
                token=ctx.settings.control_token,
            )
            kind = "applied" if res.ok else "refused"
            st.session_state["sweep_answer"] = (kind, f"Engine {engine_id}: {res.describe()}")
        except (CollectorUnavailable, ValueError) as exc:
            st.session_state["sweep_answer"] = ("refused", f"Not applied: {exc}")
        data.controls.clear()
        ui.collector_engines.clear()
answer = st.session_state.get("sweep_answer")
if answer:
    kind, text = answer
    (st.success if kind == "applied" else st.error)(as_text(text))
