"""The Chrome trace's blame arrows: a simulated run with chat streams and long prompts (known
step costs, written into a store as telemetry) exported by ``chunkscope export``; every chat
stall has an arrow from the long prompt's chunk that caused it to the chat's delayed token, and
a quiet store has none."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from advisor.blame_store import blame_window
from advisor.blame_trace import trace_links
from storage import db as dbm
from storage import export
from tests.advisor.helpers import store_run
from tests.advisor.test_blame import ENGINE, SHAPE, run, traffic

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=[4096, 512], ids=["budget4096", "budget512"])
def stored(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    reqs = traffic()
    result = run(reqs, int(request.param))
    url = f"sqlite:///{tmp_path_factory.mktemp('trace') / 'store.db'}"
    store_run(url, reqs, result, SHAPE, engine_id=ENGINE)
    return url


@pytest.fixture(scope="module")
def trace(stored: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out = tmp_path_factory.mktemp("out") / "trace.json"
    export.export(stored, export.Selection(), "chrome-trace", out, links=trace_links)
    yield json.loads(out.read_text())


def _threads(doc: dict[str, Any]) -> dict[int, str]:
    return {
        e["tid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def _enclosing(doc: dict[str, Any], tid: int, ts: float) -> list[dict[str, Any]]:
    """The chunk slices (their args have a step) on ``tid`` that hold ``ts``."""
    return [
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["tid"] == tid and "step" in e.get("args", {})
        and e["ts"] <= ts <= e["ts"] + e["dur"]
    ]  # fmt: skip


def test_every_chat_stall_has_an_arrow_from_its_culprit(stored: str, trace: dict[str, Any]) -> None:
    names = _threads(trace)
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    arrows: set[tuple[str, str, int]] = set()
    for i, s in starts.items():
        f = ends[i]
        assert s["cat"] == f["cat"] == "blame" and f["bp"] == "e" and s["ts"] <= f["ts"]
        culprit, victim = s["args"]["culprit"], s["args"]["victim"]
        assert names[s["tid"]].startswith(f"req {culprit}")
        assert names[f["tid"]].startswith(f"req {victim}")
        # from the culprit's chunk slice to the victim's slice of the token it delayed
        (src,) = _enclosing(trace, s["tid"], s["ts"])
        (dst,) = _enclosing(trace, f["tid"], f["ts"])
        assert dst["args"]["produced"] and dst["args"]["token"] == s["args"]["token"]
        assert src["args"]["step"] <= dst["args"]["step"]
        assert s["args"]["blamed_ms"] > 0
        arrows.add((culprit, victim, s["args"]["token"]))
    db = dbm.connect(stored, readonly=True)
    try:
        ledger = blame_window(db, engine_id=ENGINE).ledger
    finally:
        db.dispose()
    stalls = 0
    for i in range(4):
        gaps = ledger.gaps(f"chat-{i}")
        for g in gaps[gaps["stall"]].itertuples():
            assert (g.culprit, f"chat-{i}", g.k) in arrows
            stalls += 1
    assert stalls >= 12
    # the arrows start at the long prompts only: the chats' decodes never stall anyone
    assert {c for c, _, _ in arrows} <= {"rag-0", "rag-1", "rag-2"}


def test_chunkscope_export_draws_the_arrows(stored: str, tmp_path: Path) -> None:
    out = tmp_path / "t.json.gz"
    proc = subprocess.run(
        [sys.executable, "-m", "chunkscope.cli", "export", "--db", stored, "--format",
         "chrome-trace", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    import gzip

    doc = json.loads(gzip.decompress(out.read_bytes()))
    assert sum(1 for e in doc["traceEvents"] if e["ph"] == "s") >= 12


def test_without_links_the_trace_has_no_arrows(stored: str, tmp_path: Path) -> None:
    out = tmp_path / "plain.json"
    export.export(stored, export.Selection(), "chrome-trace", out)
    doc = json.loads(out.read_text())
    assert not [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]


def test_a_long_selection_is_blamed_in_slices_without_losing_a_stall(stored: str) -> None:
    db = dbm.connect(stored, readonly=True)
    try:
        tables = export.load_tables(db, export.Selection())
        whole = trace_links(db, tables)
        import advisor.blame_trace as bt

        old = bt.SLICE_S
        bt.SLICE_S = 0.2  # the run is about 1.5 s: several slices
        try:
            sliced = trace_links(db, tables)
        finally:
            bt.SLICE_S = old
    finally:
        db.dispose()
    key = ["victim", "k", "culprit", "culprit_step"]
    assert len(whole) >= 12
    assert sorted(map(tuple, whole[key].to_numpy())) == sorted(map(tuple, sliced[key].to_numpy()))
