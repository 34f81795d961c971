"""Stalls over a window: the scripted stall story (four chat streams, a 2,000-token RAG prompt
at steps 10, 60, 130 and 180, the budget cut from 2048 to 128 at step 120) read back through a
real collector and store."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from storage import db as storage_db
from storage import queries
from storage.stalls import long_mask, ratio, stall_window
from testkit.seed import SynthRun, send_run

MS_PER_PREFILL_TOKEN = 1 / 8  # the synthetic engine: a step is 4 ms + 1 ms per 8 prefill tokens


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, SynthRun, float]]:
    from testkit.collector import start_collector

    url = f"sqlite:///{tmp_path_factory.mktemp('stalls') / 'chunkscope.db'}"
    collector = start_collector(url)
    try:
        run = SynthRun()
        send_run(collector.url, run)
        db = storage_db.connect(url, readonly=True)
        ctrl = queries.controls(db)
        cut = float(ctrl["applied_at"].dropna().iloc[0])
        yield db, run, cut
    finally:
        collector.stop()


def _edges(db: Any) -> tuple[float, float]:
    steps = queries.steps(db)
    return float(steps["start"].min()), float(steps["end"].max())


def test_a_window_before_the_cut_holds_whole_prompt_stalls(story: Any) -> None:
    db, run, cut = story
    lo, _ = _edges(db)
    before = stall_window(db, engine_id=run.engine_id, run_id=run.run_id, since=lo, until=cut)
    # two RAG prompts (steps 10 and 60), each prefilled in one 2,000-token step that every
    # chat stream waited through: 4 ms + 250 ms, plus the decode step around it
    assert before.long_requests == 2 and before.long_met == 2 and before.met
    assert set(before.met_request_ids) == {"rag-0", "rag-1"}
    # four long chat streams from step 0; a short chat arrives with rag-1 (step 60)
    assert before.in_flight == (4, 5)
    one_step = 4 + 2000 * MS_PER_PREFILL_TOKEN
    assert one_step <= before.stall_max_ms <= one_step + 10
    assert before.stalls >= 2 * 4  # the four long chat streams, once per prompt
    assert before.gap_max_ms == before.stall_max_ms  # the worst gap of the window is a stall
    assert before.long_ttft_p50_ms is not None and before.long_ttft_p50_ms >= one_step


def test_after_the_cut_the_stalls_are_one_chunk_long(story: Any) -> None:
    db, run, cut = story
    _, hi = _edges(db)
    after = stall_window(db, engine_id=run.engine_id, run_id=run.run_id, since=cut, until=hi)
    before = stall_window(
        db, engine_id=run.engine_id, run_id=run.run_id, since=_edges(db)[0], until=cut
    )
    assert after.long_met == 2 and set(after.met_request_ids) == {"rag-2", "rag-3"}
    # 128-token steps: a chat stream waits one chunk (4 ms + 16 ms at most) per gap
    assert after.stall_max_ms is not None and after.stall_max_ms <= 4 + 128 * MS_PER_PREFILL_TOKEN
    assert after.stalls > before.stalls  # more, shorter stalls: every chunk is one
    shorter = ratio(before.stall_max_ms, after.stall_max_ms)
    assert shorter is not None and shorter > 10
    # the cost: a prompt chunked in 128-token steps waits longer for its first token
    assert after.long_ttft_p50_ms is not None and before.long_ttft_p50_ms is not None
    assert after.long_ttft_p50_ms > before.long_ttft_p50_ms


def test_a_quiet_window_holds_no_stall(story: Any) -> None:
    db, run, _cut = story
    steps = queries.steps(db)
    by_no = steps.set_index("step")
    # steps 20..55 hold no RAG prompt (the next arrives at step 60)
    lo, hi = float(by_no.loc[20, "start"]), float(by_no.loc[55, "end"])
    quiet = stall_window(db, engine_id=run.engine_id, run_id=run.run_id, since=lo, until=hi)
    assert quiet.long_requests == 0 and quiet.stalls == 0 and not quiet.met
    assert quiet.stall_max_ms is None and quiet.gaps > 0 and quiet.gap_max_ms is not None
    with pytest.raises(ValueError, match="until > since"):
        stall_window(db, engine_id=run.engine_id, run_id=run.run_id, since=hi, until=lo)


def test_long_is_an_image_or_a_long_prompt() -> None:
    import pandas as pd

    reqs = pd.DataFrame(
        {"num_prompt_tokens": [100, 1024, 5000, 80], "num_image_tokens": [0, 0, 0, 1196]}
    )
    assert long_mask(reqs).tolist() == [False, True, True, True]
    assert ratio(100.0, 0.0) is None and ratio(None, 1.0) is None and ratio(300.0, 100.0) == 3.0


def test_a_long_prompt_prefilled_at_the_windows_edge_is_met_but_not_counted(story: Any) -> None:
    """A window that ends inside the chat gaps around a long prefill (a cut made just after a
    long prompt's step): the prompt met the streams (their gaps held it), but those gaps reach
    past the window, so they are not among its stalls."""
    db, run, _cut = story
    steps = queries.steps(db).set_index("step")
    lo = float(steps.loc[0, "start"])
    long_step = 60  # rag-1, prefilled in one step
    until = float(steps.loc[long_step, "end"]) - 1e-4  # inside the long step
    window = stall_window(db, engine_id=run.engine_id, run_id=run.run_id, since=lo, until=until)
    assert "rag-1" in window.met_request_ids and window.long_met == window.long_requests == 2
    one_step = 4 + 2000 * MS_PER_PREFILL_TOKEN
    # rag-0's stalls only: each gap counted lies wholly before `until`
    whole = stall_window(
        db, engine_id=run.engine_id, run_id=run.run_id, since=lo, until=until + 1.0
    )
    assert window.stalls < whole.stalls and window.stall_max_ms is not None
    assert window.stall_max_ms <= one_step + 10
