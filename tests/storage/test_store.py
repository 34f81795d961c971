"""storage.store driven directly: what the writer keeps of a run's requests between batches."""

from __future__ import annotations

from typing import Any

from sqlalchemy import event, select

from storage import db as dbm
from storage import schema
from storage.store import Events, EventsResult, Hello, SeqHole, Store
from testkit.engines import SyntheticEngine


def _request(seq: int, rid: str, kind: str, t: int) -> dict[str, Any]:
    return {"type": "request", "seq": seq, "request_id": rid, "kind": kind, "time_ns": t}


def _step(seq: int, step: int, rids: list[str]) -> dict[str, Any]:
    chunk = {"kind": "decode", "start": 8, "num_tokens": 1, "produced_token": True}
    return {
        "type": "step",
        "seq": seq,
        "step": step,
        "start_ns": 1000 * step,
        "end_ns": 1000 * step + 500,
        "chunks": [{**chunk, "request_id": rid} for rid in rids],
    }


def test_requests_evicted_after_they_finish_are_found_again_with_one_query(db_url: str) -> None:
    """Finished requests leave the writer's memory; a later batch's new requests are looked up
    together (one query, not one per request), and a late event for an evicted request updates
    its row instead of inserting it twice."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    store.startup()
    [info] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    first = [
        _request(1, "a", "arrived", 10),
        _request(2, "b", "arrived", 11),
        _step(3, 1, ["a", "b"]),
        _request(4, "a", "finished", 2000),
    ]
    [res] = store.apply([Events(info.run_key, first)])
    assert isinstance(res, EventsResult) and res.stored == 4 and not res.bad

    lookups: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "requests" in statement:
            lookups.append(statement)

    event.listen(db, "before_cursor_execute", count)
    new = [f"n{i}" for i in range(5)]
    second = [
        _request(5, "a", "preempted", 2100),  # late, for the evicted request
        *[_request(6 + i, rid, "arrived", 2200 + i) for i, rid in enumerate(new)],
        _step(11, 2, ["b", *new]),
    ]
    [res] = store.apply([Events(info.run_key, second)])
    event.remove(db, "before_cursor_execute", count)
    assert isinstance(res, EventsResult) and res.stored == len(second) and not res.bad
    assert len(lookups) == 1, lookups

    with db.connect() as c:
        rows = c.execute(
            select(
                schema.requests.c.request_id,
                schema.requests.c.req_no,
                schema.requests.c.num_preemptions,
                schema.requests.c.finished_ns,
                schema.requests.c.num_tokens,
            ).where(schema.requests.c.run_key == info.run_key)
        ).all()
    by_id = {r.request_id: r for r in rows}
    assert sorted(by_id) == sorted(["a", "b", *new]) and len(rows) == len(by_id)
    assert len({r.req_no for r in rows}) == len(rows)
    assert by_id["a"].num_preemptions == 1 and by_id["a"].finished_ns == 2000
    assert by_id["b"].num_tokens == 2 and all(by_id[rid].num_tokens == 1 for rid in new)
    store.close()
    db.dispose()


def test_events_that_would_skip_an_unstored_seq_are_refused_unless_a_gap_declares_it(
    db_url: str,
) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    store.startup()
    [info] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    [res] = store.apply([Events(info.run_key, [_request(1, "a", "arrived", 10)])])
    assert isinstance(res, EventsResult) and res.last_seq == 1
    skipping = [_request(3, "b", "arrived", 11), _request(4, "c", "arrived", 12)]
    [res] = store.apply([Events(info.run_key, skipping)])
    assert isinstance(res, SeqHole) and res.expected == 2
    gap = {
        "type": "gap",
        "seq": 3,
        "first_seq_lost": 2,
        "last_seq_lost": 2,
        "num_events_lost": 1,
        "reason": "spill limit reached",
        "time_ns": 20,
    }
    # a hole inside one op is refused too, and nothing of the op is stored
    [res] = store.apply([Events(info.run_key, [_request(2, "b", "arrived", 11), skipping[1]])])
    assert isinstance(res, SeqHole) and res.expected == 2
    [res] = store.apply([Events(info.run_key, [gap, skipping[1]])])
    assert isinstance(res, EventsResult) and res.last_seq == 4 and res.stored == 2
    with db.connect() as c:
        gaps = c.execute(select(schema.gaps.c.first_seq_lost, schema.gaps.c.reason)).all()
        ids = c.execute(select(schema.requests.c.request_id)).scalars().all()
    assert [tuple(g) for g in gaps] == [(2, "spill limit reached")]
    assert sorted(ids) == ["a", "c"]
    store.close()
    db.dispose()


def test_a_non_finite_value_given_to_the_store_is_a_bad_event_never_stored_as_infinity(
    db_url: str,
) -> None:
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    store.startup()
    [info] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    control = {
        "type": "control",
        "seq": 1,
        "time_ns": 5,
        "key": "token_budget",
        "old_value": 512,
        "new_value": float("inf"),
        "accepted": False,
    }
    [res] = store.apply([Events(info.run_key, [control])])
    assert isinstance(res, EventsResult) and [seq for seq, _ in res.bad] == [1]
    with db.connect() as c:
        assert c.execute(select(schema.controls.c.new_value)).all() == []
    store.close()
    db.dispose()


def test_an_event_that_cannot_be_stored_leaves_a_gap_row_with_its_reason(db_url: str) -> None:
    """A seq is either stored or declared lost with a reason: an unreadable event, or one of a
    type this store does not know, is counted as received and recorded as a gap of one."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    store.startup()
    [info] = store.apply([Hello(SyntheticEngine(engine_id="e", run_id="r", seed=1).hello())])
    events = [
        _request(1, "a", "arrived", 10),
        {**_step(2, 1, ["a"]), "num_running": 2**40},  # no column holds it
        {"type": "from_the_future", "seq": 3, "time_ns": 12},
        _step(4, 2, ["a"]),
    ]
    [res] = store.apply([Events(info.run_key, events)])
    assert isinstance(res, EventsResult) and res.last_seq == 4
    assert [seq for seq, _ in res.bad] == [2] and res.unknown_types == ["from_the_future"]
    with db.connect() as c:
        gaps = c.execute(
            select(
                schema.gaps.c.seq,
                schema.gaps.c.first_seq_lost,
                schema.gaps.c.last_seq_lost,
                schema.gaps.c.num_events_lost,
                schema.gaps.c.reason,
            ).order_by(schema.gaps.c.seq)
        ).all()
        num_gap_events = c.execute(select(schema.runs.c.num_gap_events)).scalar()
    assert [tuple(g[:4]) for g in gaps] == [(2, 2, 2, 1), (3, 3, 3, 1)]
    assert "num_running" in gaps[0].reason and "from_the_future" in gaps[1].reason
    assert num_gap_events == 2
    store.close()
    db.dispose()


def test_a_hello_behind_its_runs_events_in_one_batch_answers_their_durable_seq(
    db_url: str,
) -> None:
    """An engine whose connection dropped says hello again while its last frame still waits in
    the writer's queue: both land in one batch. The hello's answer and the run's row must say
    the seq those events reached, or the engine resends them and the store refuses them
    forever (their rows are there, above a durable seq that says they are not)."""
    db = dbm.connect(db_url)
    dbm.migrate(db)
    store = Store(db)
    store.startup()
    syn = SyntheticEngine(engine_id="e", run_id="r", seed=1)
    [info] = store.apply([Hello(syn.hello())])
    store.apply([Events(info.run_key, syn.steps(3))])
    last = syn.steps(3)
    res, again = store.apply([Events(info.run_key, last), Hello(syn.hello())])
    assert isinstance(res, EventsResult) and res.last_seq == syn.seq
    assert again.last_seq == syn.seq  # what the collector answers the hello with
    with db.connect() as c:
        stored = c.execute(
            select(schema.runs.c.last_seq).where(schema.runs.c.id == info.run_key)
        ).scalar()
    assert stored == syn.seq
    more = syn.steps(2)  # the engine goes on from there
    [res] = store.apply([Events(info.run_key, more)])
    assert isinstance(res, EventsResult) and res.last_seq == syn.seq and not res.bad
    store.close()
    db.dispose()
