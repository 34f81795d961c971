"""benchmarks/cap.py's bookkeeping, without an engine: the window plan alternates the arms, a
request counts in the window it was sent in, a gap in the window of its earlier token, ratios
are cap-on over cap-off at the same budget. No timing is asserted."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def cap() -> ModuleType:
    """The benchmark module (benchmarks/ is a package: no path edits)."""
    return importlib.import_module("benchmarks.cap")


def test_windows_alternate_arms(cap: ModuleType) -> None:
    ws = cap.plan_windows([512, 128], [0, 128], 2, 16384)
    assert [(w.budget, w.cap) for w in ws] == [
        (512, 0), (512, 128), (512, 128), (512, 0),
        (128, 0), (128, 0),
        (16384, 0), (16384, 0),
    ]  # fmt: skip
    assert [w.index for w in ws] == list(range(8))  # cap 128 cuts nothing at budget 128


def test_figures_and_ratios(cap: ModuleType) -> None:
    slow = cap.ClientRequest("chat", 100, sent=1.0)
    slow.chunk_times = [3.0, 3.1, 3.2]  # TTFT 2 s, in window 0
    fast = cap.ClientRequest("chat", 100, sent=11.0)
    fast.chunk_times = [11.2, 11.3, 11.4]
    rag = cap.ClientRequest("rag", 5000, sent=1.5)
    rag.chunk_times = [12.0]  # sent in window 0: its TTFT counts there
    failed = cap.ClientRequest("chat", 10, sent=12.0, error="HTTP 503")
    served = {
        "requests": [slow, fast, rag, failed],
        "windows": [
            {"budget": 512, "cap": 0, "start": 0.0, "end": 10.0},
            {"budget": 512, "cap": 128, "start": 10.0, "end": 20.0},
        ],
    }
    res = cap.analyse(served)
    off, on = res["arms"]
    assert off["chat_ttft_max_ms"] == pytest.approx(2000)
    assert off["rag_ttft_p50_ms"] == pytest.approx(10500)
    assert on["chat_ttft_max_ms"] == pytest.approx(200) and on["num_rag"] == 0
    assert on["errors"] == 1 and off["errors"] == 0
    assert off["chat_itl_max_ms"] == pytest.approx(100)
    assert off["tokens_per_s"] == pytest.approx(0.3) and on["tokens_per_s"] == pytest.approx(0.4)
    [ratio] = res["ratios"]
    assert ratio["budget"] == 512 and ratio["cap"] == 128
    assert ratio["chat_ttft_p99_ms"] == pytest.approx(0.1, rel=0.05)
    assert ratio["rag_ttft_p50_ms"] is None  # no RAG in the cap-on window
    assert "| 512 | off |" in cap.markdown(res)
