"""benchmarks/blame.py's parts that decide what it measures: the same schedule in every run of
a mix, fresh prompt content per run (a repeated prompt would hit the prefix cache), the
crossover (each run holds every other culprit, each chat is the victim of one culprit, chosen
from the schedule), the sums it compares, and the simulated busy store its speed is timed
on."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.blame import (
    MIXES,
    build_parser,
    busy_minute_store,
    in_run,
    plan,
    prompt_ids,
    summarize_pairs,
)


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


def test_each_run_holds_every_other_culprit_and_each_chat_has_one() -> None:
    args = _args()
    planned = plan(MIXES["chunked"], args, 7)
    rags = [p for p in planned if p.traffic_class == "rag"]
    chats = [p for p in planned if p.traffic_class == "chat"]
    assert [r.episode for r in rags] == list(range(len(rags))) and len(rags) >= 4
    for parity in (0, 1):
        sent = [p for p in planned if in_run(p, parity)]
        assert [p for p in sent if p.traffic_class == "chat"] == chats  # every chat, every run
        assert [r.episode for r in sent if r.traffic_class == "rag"] == [
            e for e in range(len(rags)) if e % 2 == parity
        ]
    # a chat is the victim of the last culprit sent no later than 1 s after it
    for c in chats:
        before = [r for r in rags if r.offset_s - args.victims_before_s <= c.offset_s]
        assert c.episode == (before[-1].episode if before else None)
    assert any(c.episode is None for c in chats)  # the controls, before the first culprit
    assert {c.episode for c in chats} >= set(range(len(rags)))


def test_the_sums_compare_each_victim_with_and_without_its_culprit() -> None:
    """Two victims (of culprits 0 and 1) and a control. Victim 1 is also reached by culprit 0
    in the run without its own: the ledger's blame there is taken off its blamed figure."""
    args = _args()
    args.duration_s, args.rag_first_s, args.rag_every_s, args.chat_every_s = 9.0, 3.0, 4.0, 3.0
    planned = plan(MIXES["one-step"], args, 1)
    chats = {p.offset_s: p for p in planned if p.traffic_class == "chat"}
    control, v0, v1 = chats[0.0].index, chats[3.0].index, chats[6.0].index
    assert (chats[0.0].episode, chats[3.0].episode, chats[6.0].episode) == (None, 0, 1)
    fit = {"num_culprits": 1}

    def parts(own: float, pause: float, excess: float) -> dict[str, float]:
        return {"own": own, "pause": pause, "excess": excess}

    pair = {
        "first": 0,
        # run 0: culprit 0 present (v0 slowed by 500 ms, v1 by 100 ms of spill-over)
        "run0": {"times": {control: 400.0, v0: 900.0, v1: 500.0},
                 "blame": {control: 0.0, v0: 450.0, v1: 90.0},
                 "parts": {control: parts(380, 10, 10), v0: parts(390, 20, 490),
                           v1: parts(380, 10, 110)}, **fit},
        # run 1: culprit 1 present (v1 slowed by 300 ms)
        "run1": {"times": {control: 420.0, v0: 400.0, v1: 700.0},
                 "blame": {control: 0.0, v0: 0.0, v1: 310.0},
                 "parts": {control: parts(400, 10, 10), v0: parts(380, 10, 10),
                           v1: parts(370, 10, 320)}, **fit},
    }  # fmt: skip
    out = summarize_pairs(planned, [pair])
    assert (out["num_victims"], out["num_controls"]) == (2, 1)
    # measured: (900 - 400) + (700 - 500); blamed: 450 + (310 - 90)
    assert out["measured_ms"] == 700.0 and out["blamed_ms"] == 670.0
    assert out["within_20pct"]
    (p,) = out["per_pair"]
    assert p["blamed_in_runs_without_ms"] == 90.0 and p["controls_run1_minus_run0_ms"] == 20.0
    assert out["per_victim_ms"][str(v1)]["blamed_without"] == [90.0]
    # where the measured difference went, by the ledger's parts: v0 500 = 450 blamed + 10 own
    # + 10 pause + 30 others; v1 200 = 220 blamed - 10 own + 0 pause - 10 others
    reached = out["where_it_went"]["reached"]
    assert reached == {"victims": 2, "measured_ms": 700.0, "blamed_ms": 670.0, "own_ms": 0.0,
                       "pause_ms": 10.0, "others_ms": 20.0}  # fmt: skip
    assert out["where_it_went"]["not_reached"]["victims"] == 0
