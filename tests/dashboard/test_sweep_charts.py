"""The Sweep page's Pareto chart and table on fixed documents."""

from __future__ import annotations

from dashboard.sweep_charts import FIGURES as FIGS
from dashboard.sweep_charts import pareto_figure, split_windows, sweep_table


def w(budget: int, itl: float | None, ttft: float | None, tps: float = 10.0, **kw: float) -> dict:
    return {"budget": budget, "itl_p99_ms": itl, "ttft_p99_ms": ttft, "tokens_per_s": tps, **kw}


SWEEP = {
    "tool": "chunkscope-loadgen-sweep",
    "windows": [
        w(128, 40.0, 2000.0, predicted_itl_p99_ms=38.0, predicted_ttft_p99_ms=1900.0),
        w(512, 110.0, 800.0, predicted_itl_p99_ms=100.0, predicted_ttft_p99_ms=850.0),
        w(2048, 480.0, 650.0, predicted_itl_p99_ms=500.0, predicted_ttft_p99_ms=600.0),
        w(4096, 500.0, 700.0),  # dominated by 2048; no prediction
    ],
    "recommended_budget": 512,
    "recommendation_source": "measured",
}
PREDICTION = {"tool": "chunkscope-advisor", "windows": [w(128, 30.0, 900.0), w(256, None, 5.0)]}


def test_split_windows() -> None:
    measured, predicted = split_windows(SWEEP)
    assert [x["budget"] for x in measured] == [128, 512, 2048, 4096]
    assert [x["budget"] for x in predicted] == [128, 512, 2048]
    assert predicted[0]["itl_p99_ms"] == 38.0 and predicted[0]["tokens_per_s"] is None
    measured, predicted = split_windows(PREDICTION)
    assert measured == [] and [x["budget"] for x in predicted] == [128, 256]
    assert split_windows(None) == ([], [])


def test_pareto_figure_measured_predicted_slo_and_recommendation() -> None:
    measured, predicted = split_windows(SWEEP)
    fig = pareto_figure(
        measured,
        predicted,
        slo_itl_ms=120.0,
        slo_ttft_ms=1500.0,
        recommended_budget=512,
        recommendation_source="measured",
    )
    names = [t.name for t in fig.data]
    assert names == ["measured", "predicted", "recommended: 512"]
    m = fig.data[0]
    assert list(m.text) == ["128", "512", "2048", "4096"]
    assert list(m.x) == [2000.0, 800.0, 650.0, 700.0] and list(m.y) == [40.0, 110.0, 480.0, 500.0]
    # the Pareto front is drawn larger: 4096 is dominated by 2048
    assert list(m.marker.size) == [14, 14, 14, 9]
    assert [c[2] for c in m.customdata] == [True, True, True, False]
    ring = fig.data[2]
    assert (list(ring.x), list(ring.y)) == ([800.0], [110.0])
    shapes = fig.layout.shapes
    assert {(s.type, s.y0 if s.y0 == s.y1 else s.x0) for s in shapes} == {
        ("line", 120.0),
        ("line", 1500.0),
    }
    assert fig.layout.xaxis.title.text == "TTFT p99 (ms)"
    assert fig.layout.yaxis.title.text == "ITL p99 (ms)"


def test_pareto_figure_prediction_only_and_empty() -> None:
    measured, predicted = split_windows(PREDICTION)
    fig = pareto_figure(
        measured, predicted, recommended_budget=128, recommendation_source="predicted"
    )
    assert [t.name for t in fig.data] == ["predicted", "recommended: 128"]
    assert list(fig.data[0].text) == ["128"]  # 256 has no ITL: not drawn
    empty = pareto_figure([], [])
    assert not empty.data and "No sweep" in empty.layout.annotations[0].text


def test_sweep_table_side_by_side() -> None:
    measured, predicted = split_windows(SWEEP)
    table = sweep_table(measured, predicted)
    assert list(table["budget"]) == [128, 512, 2048, 4096]
    assert table.loc[0, "itl_p99_ms"] == 40.0 and table.loc[0, "predicted itl_p99_ms"] == 38.0
    assert table["predicted itl_p99_ms"].isna().tolist() == [False, False, False, True]
    only = sweep_table([], split_windows(PREDICTION)[1])
    assert "itl_p99_ms" not in only.columns and "predicted itl_p99_ms" in only.columns


def test_pairs_one_line_per_cap_labels_and_recommendation() -> None:
    doc = {
        "tool": "chunkscope-loadgen-sweep",
        "windows": [
            w(512, 110.0, 2400.0, cap=0),
            w(512, 112.0, 300.0, cap=256, predicted_itl_p99_ms=100.0),
            w(2048, 480.0, 900.0, cap=0),
            w(2048, 470.0, 450.0, cap=256),
        ],
    }
    measured, predicted = split_windows(doc)
    assert predicted == [
        {
            "budget": 512,
            "cap": 256,
            **{k: None for k in FIGS},
            "itl_p99_ms": 100.0,
            "overloaded": False,
            "overload_reason": None,
        }
    ]
    fig = pareto_figure(measured, [], recommended_budget=512, recommended_cap=256)
    names = [t.name for t in fig.data]
    assert names[:2] == ["measured, cap off", "measured, cap 256"]
    capped = fig.data[1]
    assert list(capped.text) == ["512/256", "2048/256"]
    assert list(capped.x) == [300.0, 450.0]
    assert list(fig.data[0].marker.size) == [14, 9]  # 2048 cap off is dominated by 2048/256
    ring = fig.data[-1]
    assert ring.name == "recommended: 512/256" and list(ring.x) == [300.0]
    table = sweep_table(measured, predicted)
    assert list(table.columns[:2]) == ["budget", "cap"]
    assert table[["budget", "cap"]].values.tolist() == [
        [512, 0],
        [512, 256],
        [2048, 0],
        [2048, 256],
    ]
