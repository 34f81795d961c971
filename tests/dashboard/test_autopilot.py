"""The dashboard's side of the autopilot: its events read back from the store's controls, the
Live page's figure, the switch's command line, and no marker for a status."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from advisor.autopilot_run import build_parser
from dashboard import charts
from dashboard.autopilot import AutopilotSwitch, SwitchSlo, autopilot_events, latest_status
from wire import credentials

CHANGE = (
    "autopilot: budget 2048 cap off -> budget 256 cap off (3 more of 9 requests meet ...): "
    "predicted chat ITL p99 45 ms, TTFT p99 900 ms, 9/9 meet; left budget 2048 cap off: "
    "predicted chat ITL p99 800 ms, TTFT p99 300 ms, 6/9 meet"
)


def controls() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "time": [100.0, 110.0, 120.0, 130.0],
            "key": ["token_budget"] * 4,
            "old_value": [2048, 2048, 256, 256],
            "new_value": [2048, 256, 256, 512],
            "accepted": [True, True, True, True],
            "source": ["autopilot", "autopilot", "autopilot", "collector"],
            "reason": ["autopilot on: ...", CHANGE, "autopilot holds budget 256 cap off: poor fit",
                       None],
            "applied_at": [100.0, 110.0, 120.0, 130.0],
            "applied_at_step": [1, 2, 3, 4],
        }
    )  # fmt: skip


def test_autopilot_events_read_the_predictions_back() -> None:
    ev = autopilot_events(controls())
    assert list(ev["time"]) == [100.0, 110.0, 120.0]  # the manual control is not the autopilot's
    assert list(ev["change"]) == [False, True, False]
    assert ev["pred_itl_p99_ms"].iloc[1] == 45.0 and ev["pred_ttft_p99_ms"].iloc[1] == 900.0
    assert pd.isna(ev["pred_itl_p99_ms"].iloc[0])
    assert latest_status(controls(), now=125.0) == (
        "autopilot holds budget 256 cap off: poor fit (5 s ago)"
    )
    assert latest_status(None) is None


def test_figure_draws_settings_and_predictions() -> None:
    ev = autopilot_events(controls())
    itl = pd.DataFrame({"time": [101.0, 112.0], "itl_ms": [30.0, 700.0],
                        "traffic_class": ["chat", "chat"]})  # fmt: skip
    reqs = pd.DataFrame({"arrival": [101.0], "first_token": [101.5], "ttft_ms": [500.0]})
    fig = charts.autopilot_figure(ev, itl, reqs)
    names = [t.name for t in fig.data]
    assert "budget (autopilot)" in names and "predicted ITL p99" in names
    pred = next(t for t in fig.data if t.name == "predicted TTFT p99")
    assert list(pred.y) == [900.0]
    assert charts.autopilot_figure(autopilot_events(None), None, None).layout.annotations


def test_a_status_is_no_budget_marker() -> None:
    marks = charts.control_marker_times(controls())
    assert len(marks) == 2  # 2048 -> 256 and the manual 256 -> 512; no-change statuses skipped


def test_switch_runs_the_cli_with_the_slos(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sw = AutopilotSwitch(tmp_path)
    argv = sw.argv("ws://127.0.0.1:1", "e1", SwitchSlo(80, 1500, 400))
    assert "tok" not in " ".join(argv)  # the token travels in the child's environment
    monkeypatch.setenv(credentials.CONTROL_ENV, "tok")
    args = build_parser().parse_args(argv[3:])
    assert (args.slo_itl_ms, args.slo_ttft_ms, args.slo_itl_max_ms) == (80, 1500, 400)
    assert (args.engine, args.token) == ("e1", "tok")
    assert sw.state("e1") == "off"
    with pytest.raises(ValueError, match="ITL p99"):
        sw.start("ws://127.0.0.1:1", "e1", "sqlite:///x.db", SwitchSlo(0, 1500))
    # what the Control page says it started with (it showed the dataclass's repr before)
    assert SwitchSlo(250, 2000).label() == "chat ITL p99 <= 250 ms, TTFT p99 <= 2000 ms"
    assert SwitchSlo(80, 1500, 400).label().endswith(", ITL max <= 400 ms")
