"""The typed frame decoder (storage.frames) and the batched stamping of its steps
(storage.stamping): the same dicts as the general parser, the same rows in the store, and the
general path for every frame or value it does not take."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from sqlalchemy import text

from storage import db as dbm
from storage import frames, ingest
from storage.frames import CheckedEvent
from storage.store import Events, Hello, Store
from testkit.engines import SyntheticEngine
from testkit.engines import frames as cut_frames


def _engine(seed: int = 3) -> SyntheticEngine:
    return SyntheticEngine(
        engine_id="eq",
        run_id=f"run-{seed}",
        seed=seed,
        concurrency=12,
        token_budget=40,
        max_token_budget=4096,
        prompt_tokens=(8, 90),
        output_tokens=(3, 20),
    )


def _texts(eng: SyntheticEngine, n_steps: int, per_frame: int) -> list[str]:
    events = eng.steps(n_steps)
    return [json.dumps(f) for f in cut_frames(eng, events, per_frame=per_frame)]


def _general(msg: dict[str, Any]) -> dict[str, Any]:
    """A decoded frame as plain JSON values, keys with null left out (as absent)."""
    out = dict(msg)
    events = []
    for ev in msg["events"]:
        d = {k: v for k, v in ev.items() if v is not None}
        if type(ev) is CheckedEvent and "chunks" in d:
            d["chunks"] = [msgspec.structs.asdict(c) for c in d["chunks"]]
        events.append(d)
    out["events"] = events
    return out


def test_a_plain_frame_decodes_to_what_the_general_parser_reads() -> None:
    eng = _engine()
    texts = _texts(eng, 120, per_frame=40)
    assert any('"prefill"' in t for t in texts) and any('"decode"' in t for t in texts)
    for raw in texts:
        plain = frames.decode_plain(raw)
        assert plain is not None
        assert all(type(ev) is CheckedEvent for ev in plain["events"])
        general, why = ingest.parse(raw)
        assert general is not None, why
        assert _general(plain) == _general(general)


def _one_step_frame(**change: Any) -> dict[str, Any]:
    eng = _engine()
    events = eng.steps(30)
    step = next(ev for ev in events if ev["type"] == "step" and ev["chunks"])
    (frame,) = cut_frames(eng, [step], per_frame=1)
    for key, value in change.items():
        if key.startswith("chunk_"):
            step["chunks"][0][key[len("chunk_") :]] = value
        elif key.startswith("frame_"):
            frame[key[len("frame_") :]] = value
        else:
            step[key] = value
    return frame


@pytest.mark.parametrize(
    "change",
    [
        {"chunk_request_id": "req\u00e9"},  # not ASCII
        {"chunk_request_id": "a\nb"},  # an escape
        {"chunk_request_id": "a\x7fb"},  # DEL
        {"chunk_request_id": "r" * (ingest.MAX_TEXT_CHARS + 1)},  # cut by clean_text
        {"chunk_request_id": 7},
        {"chunk_start": 2**31},  # past the packed int32
        {"chunk_num_tokens": -(2**31) - 1},
        {"chunk_produced_token": 1},  # truthy, not a bool
        {"chunk_extra": 1},  # a field the contract does not have
        {"step": 1.0},
        {"num_running": True},
        {"policy": 3},
        {"policy": "p" * (ingest.MAX_TEXT_CHARS + 1)},
        {"extra": {"deep": [1]}},
        {"frame_engine_id": None},  # a null id is the general path's to refuse
        {"frame_extra": 1},
        {"type": "control"},
    ],
)
def test_any_other_frame_is_left_to_the_general_parser(change: dict[str, Any]) -> None:
    frame = _one_step_frame(**change)
    raw = json.dumps(frame)
    assert json.loads(raw) == frame
    assert frames.decode_plain(raw) is None
    assert frames.decode_plain(raw.encode()) is None  # bytes: refused by the general parser


def _rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    db = dbm.connect(url, readonly=True)
    try:
        with db.connect() as conn:
            out = {}
            for table, order in (
                ("steps", "run_key, seq"),
                ("request_events", "run_key, seq"),
                ("gaps", "run_key, seq"),
                ("requests", "run_key, req_no"),
            ):
                rows = conn.execute(text(f"SELECT * FROM {table} ORDER BY {order}"))
                # a gap's last column, its wall time, is when it was stored (no time_ns)
                out[table] = [tuple(r)[:-1] if table == "gaps" else tuple(r) for r in rows]
            cols = "last_seq, last_step, last_step_end_ns, num_steps, num_events, num_gap_events, "
            cols += "next_req_no, token_budget, policy"
            out["runs"] = [tuple(r) for r in conn.execute(text(f"SELECT {cols} FROM runs"))]
        return out
    finally:
        db.dispose()


def _store(
    url: str, texts: list[str], *, plain: bool, hello: dict[str, Any], per_batch: int = 1
) -> Store:
    """Every frame through the verdict into a store: with ``plain``, as the collector reads
    them (the typed decoder, else the general parser), else all general; ``per_batch`` frames
    in each transaction (more than one: with a hello of the run among them, as when an engine
    reconnects while its frames wait for the writer)."""
    db = dbm.connect(url)
    dbm.migrate(db)
    store = Store(db)
    info = store.apply([Hello(dict(hello))])[0]
    expected = 1
    ops: list[Any] = []
    for raw in texts:
        msg = frames.decode_plain(raw) if plain else None
        if msg is None:
            msg, why = ingest.parse(raw)
            assert msg is not None, why
        verdict = ingest.frame(
            msg, engine_id=hello["engine_id"], run_id=hello["run_id"], expected=expected
        )
        expected = verdict.expected
        ops.append(Events(info.run_key, verdict.accepted))
        if len(ops) == per_batch:
            if per_batch > 1:
                ops.insert(per_batch // 2, Hello(dict(hello)))
            results = store.apply(ops)
            assert not any(isinstance(r, BaseException) for r in results)
            ops = []
    if ops:
        store.apply(ops)
    store.close()
    db.dispose()
    return store


def test_plain_frames_store_the_rows_the_general_path_stores_one_frame_at_a_time(
    db_url: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    eng = _engine(seed=5)
    hello = eng.hello()
    texts = _texts(eng, 400, per_frame=37)
    assert all(frames.decode_plain(raw) is not None for raw in texts)
    if db_url.startswith("sqlite"):
        other = f"sqlite:///{tmp_path / 'general.db'}"
    else:
        other = request.getfixturevalue("pg_server").create_database()
    _store(db_url, texts, plain=True, hello=hello, per_batch=3)
    _store(other, texts, plain=False, hello=hello)
    fast, general = _rows(db_url), _rows(other)
    assert fast["steps"] and fast["requests"]
    assert sum(r[0] for r in fast["runs"]) > 0
    assert fast == general


def test_a_step_whose_gap_would_not_fit_is_an_unreadable_event_on_both_paths(
    sqlite_url: str, tmp_path: Any
) -> None:
    """A step far in the past gives a new request its first token (a frame the general path
    reads: its end_ns is far below zero), then a plain step gives it the next: the gap is past
    int64, so the op goes chunk by chunk and the step becomes an unreadable event (a gap row),
    as on the general path; nothing else differs."""
    eng = _engine(seed=7)
    hello = eng.hello()
    events = eng.steps(60)
    steps = [ev for ev in events if ev["type"] == "step" and ev["chunks"]]
    odd = steps[10]
    odd["end_ns"] = -(2**63) + 5
    odd["policy"] = "chunked\n"  # an escape: not a plain frame
    odd["chunks"] = [dict(odd["chunks"][0], request_id="a-new-request", produced_token=True)]
    later = steps[11]
    later["chunks"][0] = dict(odd["chunks"][0], start=odd["chunks"][0]["start"] + 1)
    text_frames = []
    for ev in events:
        (frame,) = cut_frames(eng, [ev], per_frame=1)
        text_frames.append(json.dumps(frame))
    assert frames.decode_plain(text_frames[events.index(odd)]) is None
    assert frames.decode_plain(text_frames[events.index(later)]) is not None
    other = f"sqlite:///{tmp_path / 'general.db'}"
    _store(sqlite_url, text_frames, plain=True, hello=hello)
    fast = _rows(sqlite_url)
    assert any(
        g[1] == later["seq"] and "unreadable event: OverflowError" in str(g) for g in fast["gaps"]
    )
    _store(other, text_frames, plain=False, hello=hello)
    assert _rows(other) == fast
