"""benchmarks/blame.py's parts that decide what it measures: the same schedule in every run of
a mix, fresh prompt content per run (a repeated prompt would hit the prefix cache), and the
simulated busy store its speed is timed on."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.blame import MIXES, build_parser, busy_minute_store, plan, prompt_ids


def _args() -> argparse.Namespace:
    return build_parser().parse_args([])


def test_every_run_of_a_mix_has_the_same_schedule_and_fresh_prompts() -> None:
    args = _args()
    a, b = plan(MIXES["one-step"], args, 7), plan(MIXES["one-step"], args, 7)
    assert [(p.index, p.offset_s, p.traffic_class, p.length) for p in a] == [
        (p.index, p.offset_s, p.traffic_class, p.length) for p in b
    ]
    rags = [p for p in a if p.traffic_class == "rag"]
    assert rags and all(1000 <= p.length <= 1600 for p in rags)
    assert [p.offset_s for p in a] == sorted(p.offset_s for p in a)
    p = rags[0]
    one, two = prompt_ids(p, 1), prompt_ids(p, 2)
    assert len(one) == len(two) == p.length and one[0] == two[0] == 256
    assert one != two and prompt_ids(p, 1) == one  # new content per run, seeded


def test_the_busy_store_blames_the_long_prompts(tmp_path: Path) -> None:
    from advisor.blame_store import blame_window
    from storage import db as dbm

    url, steps = busy_minute_store(tmp_path / "busy.db", streams=8, seconds=4.0)
    assert steps > 50
    db = dbm.connect(url, readonly=True)
    try:
        top = blame_window(db, engine_id="busy").ledger.offenders(2)
    finally:
        db.dispose()
    assert [o["traffic_class"] for o in top] == ["rag", "rag"]
