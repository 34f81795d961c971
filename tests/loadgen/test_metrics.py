"""Summary formulas, the table, the progress bar, and import hygiene (no torch, no engine)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from loadgen.metrics import Slo, stats_ms, summarize_all
from loadgen.progress import Progress
from loadgen.record import RequestRecord
from loadgen.report import table


def _rec(i: int, cls: str, ttft: float, tpot: float, n: int = 11, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, cls, 0.0, n, 100, send_wall=1000.0 + i, sent_s=float(i), queue_s=0.001)
    if not ok:
        r.fail("http 500: boom")
        r.e2e_s = 0.01
        return r
    r.status, r.ttft_s, r.tpot_s = "ok", ttft, tpot
    r.e2e_s = ttft + tpot * (n - 1)
    r.itl_s = [tpot] * (n - 1)
    r.prompt_tokens, r.output_tokens = 100, n
    return r


def test_stats_ms() -> None:
    s = stats_ms([0.001 * v for v in range(1, 101)])
    assert s["count"] == 100 and s["p50"] == pytest.approx(50.5) and s["max"] == pytest.approx(100)
    assert s["p99"] == pytest.approx(99.01) and stats_ms([])["p50"] is None


def test_summary_goodput_and_classes() -> None:
    recs = [
        _rec(0, "chat", 0.1, 0.02),
        _rec(1, "chat", 0.5, 0.02),
        _rec(2, "rag", 0.1, 0.08),
        _rec(3, "rag", 0.1, 0.02, ok=False),
    ]
    s = summarize_all(recs, Slo(ttft_ms=200, itl_ms=50))
    ov = s["overall"]
    assert (ov["requests"], ov["ok"], ov["errors"]) == (4, 3, 1)
    assert ov["error_kinds"] == {"http 500": 1}
    assert ov["goodput"]["requests_meeting_slo"] == 1  # only request 0 meets both
    w = ov["throughput"]["window_s"]
    assert w == pytest.approx(3.01)  # first send -> last response end (the failed one)
    assert ov["throughput"]["output_tokens_per_s"] == pytest.approx(33 / w)
    assert ov["itl_ms"]["count"] == 30 and ov["ttft_ms"]["count"] == 3
    assert set(s["classes"]) == {"chat", "rag"}
    assert s["classes"]["chat"]["throughput"]["window_s"] == w
    assert s["classes"]["rag"]["goodput"]["requests_meeting_slo"] == 0
    text = table(s)
    assert "overall" in text and "http 500: 1" in text and "TTFT <= 200 ms" in text
    json.dumps(s, allow_nan=False)


def test_empty_summary_is_json_clean() -> None:
    s = summarize_all([], Slo())
    json.dumps(s, allow_nan=False)
    assert s["overall"]["throughput"]["requests_per_s"] is None
    assert "no SLO set" in table(s)


def test_progress_bar() -> None:
    buf = io.StringIO()
    p = Progress(10, stream=buf, line_every_s=0.0)
    p.update(5, 3, 1)
    p.update(10, 10, 1, final=True)
    out = buf.getvalue().splitlines()
    assert len(out) == 2 and "3/10 done" in out[0] and "errors 1" in out[0]
    silent = io.StringIO()
    Progress(10, enabled=False, stream=silent).update(1, 1, 0)
    assert silent.getvalue() == ""


def test_loadgen_never_imports_torch_or_engine() -> None:
    code = (
        "import sys, loadgen.cli, loadgen.mockserver; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
