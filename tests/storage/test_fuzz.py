"""Property-based fuzz (hypothesis) of the ingest rules, the store behind them and the control
path: thousands of random and mutated frames and messages. No crash, no stored row outside the
contract (every integer within its column's type on every backend, seqs unique per run), and a
real run fed between the attacks stays intact. Example counts are bounded (the file runs in a
few seconds); the ``derandomize`` setting keeps a failure reproducible."""

from __future__ import annotations

import json
import random
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings
from sqlalchemy import func, select
from websockets.sync.client import connect

from storage import db as dbm
from storage import ingest, schema
from storage.store import Events, EventsResult, Hello, RunInfo, Store
from testkit.collector import collector_in_thread
from testkit.engines import FakeEngineClient, SyntheticEngine
from wire import strict_json
from wire.control import ControlRefused, check_changes
from wire.events import SCHEMA_VERSION

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# JSON values, with integers well past every column type, and text that is not ASCII
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=6,
)

_TEMPLATE = SyntheticEngine(engine_id="t", run_id="t", seed=7, max_token_budget=2048)
TEMPLATES: list[dict[str, Any]] = _TEMPLATE.steps(6) + [
    _TEMPLATE.control("token_budget", 256, accepted=True),
    _TEMPLATE.gap(_TEMPLATE.seq + 1, _TEMPLATE.seq + 3),
]
KEYS = sorted({k for e in TEMPLATES for k in e} | {"chunks", "new_value", "type", "seq"})


@st.composite
def mutated_event(draw: st.DrawFn) -> dict[str, Any]:
    """A real event with a few fields replaced, removed or added."""
    ev = json.loads(json.dumps(draw(st.sampled_from(TEMPLATES))))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(KEYS))
        how = draw(st.integers(0, 2))
        if how == 0:
            ev.pop(key, None)
        else:
            ev[key] = draw(json_values)
    if draw(st.booleans()) and isinstance(ev.get("chunks"), list) and ev["chunks"]:
        chunk = ev["chunks"][0]
        if isinstance(chunk, dict):
            chunk[draw(st.sampled_from(["start", "num_tokens", "request_id", "kind"]))] = draw(
                json_values
            )
    return ev


events_lists = st.lists(
    mutated_event() | st.dictionaries(st.text(max_size=6), json_values), max_size=8
)


@st.composite
def frames(draw: st.DrawFn) -> Any:
    """An events frame (seqs near the expected one, or anything), a random JSON value, or text."""
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(json_values)
    if kind == 1:
        return draw(st.text(max_size=40))
    events = draw(events_lists)
    seq = draw(st.integers(0, 6))
    for ev in events:
        if isinstance(ev, dict) and draw(st.integers(0, 4)):
            seq += draw(st.integers(0, 2))
            ev["seq"] = seq
    frame: dict[str, Any] = {"type": "events", "schema": SCHEMA_VERSION, "events": events}
    if kind == 4:
        frame[draw(st.sampled_from(["type", "schema", "engine_id", "events"]))] = draw(json_values)
    return frame


NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 2**31 - 1, 2**31, -(2**31) - 1, 2**53, 2**53 + 1, 2**63 - 1,
    2**63, -(2**63) - 1, 10**30, 0.5, -1e308, 1e308, "", "x", "é", "\u0000", "9" * 300,
    [], {}, [[[[]]]], {"a": {"b": {"c": 1}}}, ["request", 1], {"seq": 1},
]  # fmt: skip


def nasty(rng: random.Random) -> Any:
    if rng.random() < 0.3:
        return rng.randint(-(2**66), 2**66)
    return json.loads(json.dumps(rng.choice(NASTY)))


def rng_event(rng: random.Random) -> dict[str, Any]:
    """A real event with a few fields replaced, removed or added (plain ``random``: thousands
    of these per second, where a hypothesis strategy of the same shape is ~100x slower)."""
    ev = json.loads(json.dumps(rng.choice(TEMPLATES)))
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(KEYS)
        if rng.random() < 0.3:
            ev.pop(key, None)
        else:
            ev[key] = nasty(rng)
    chunks = ev.get("chunks")
    if rng.random() < 0.3 and isinstance(chunks, list) and chunks and isinstance(chunks[0], dict):
        chunks[0][rng.choice(["start", "num_tokens", "request_id", "kind", "produced_token"])] = (
            nasty(rng)
        )
    return ev


def rng_frame(rng: random.Random, expected: int) -> str:
    """An events frame with seqs near ``expected``, sometimes mangled as text."""
    events: list[Any] = []
    seq = expected - rng.randint(0, 2)
    for _ in range(rng.randint(0, 6)):
        ev = rng_event(rng) if rng.random() < 0.9 else nasty(rng)
        if isinstance(ev, dict) and rng.random() < 0.85:
            seq += 1 if rng.random() < 0.8 else rng.randint(0, 3)
            ev["seq"] = seq
        events.append(ev)
    frame: dict[str, Any] = {"type": "events", "schema": SCHEMA_VERSION, "events": events}
    if rng.random() < 0.1:
        frame[rng.choice(["type", "schema", "engine_id", "run_id", "events"])] = nasty(rng)
    text = json.dumps(frame)
    if rng.random() < 0.1:  # mangled text: truncated, a byte changed, NaN, deep nesting
        i = rng.randrange(len(text))
        text = rng.choice(
            [text[:i], text[:i] + rng.choice("{}[]\",:0aN") + text[i + 1 :],
             text.replace("0", "NaN", 1), "[" * 5000 + "]" * 5000]
        )  # fmt: skip
    return text


def _text(frame: Any) -> str:
    return frame if isinstance(frame, str) else json.dumps(frame)


def _check_frame(text: str, expected: int) -> int:
    """Run one frame through the rules; the next expected seq."""
    msg, why = ingest.parse(text)
    if msg is None:
        assert why
        return expected
    verdict = ingest.frame(msg, engine_id="e", run_id="r", expected=expected)
    if verdict.close or verdict.control_ack is not None:
        assert not verdict.accepted
        return expected
    assert expected <= verdict.expected <= ingest.MAX_SEQ + 1
    nxt = expected
    for ev in verdict.accepted:  # contiguous, or a declared, bounded gap
        assert ev["seq"] == nxt or ingest.declares(ev, nxt)
        nxt = ev["seq"] + 1
    assert nxt == verdict.expected
    return verdict.expected


@settings(FUZZ, max_examples=80)
@given(frame=frames(), expected=st.integers(1, 8))
def test_ingest_rules_on_generated_frames(frame: Any, expected: int) -> None:
    _check_frame(_text(frame), expected)


@settings(FUZZ, max_examples=60)
@given(seed=st.integers(0, 2**32 - 1))
def test_ingest_rules_on_thousands_of_mutated_frames(seed: int) -> None:
    rng = random.Random(seed)
    expected = 1
    for _ in range(50):  # 3,000 frames in all
        expected = _check_frame(rng_frame(rng, expected), expected)


def _int_columns_in_range(db: Any) -> None:
    """Every stored integer fits its column's type on every backend."""
    with db.connect() as c:
        for table in schema.metadata.sorted_tables:
            for column in table.columns:
                bits = ingest._bits(column.type)
                if bits is None:
                    continue
                lo, hi = c.execute(select(func.min(column), func.max(column))).one()
                for v in (lo, hi):
                    assert v is None or -(2 ** (bits - 1)) <= v < 2 ** (bits - 1), (column, v)


def test_store_fuzz_keeps_the_contract_and_the_real_run(tmp_path: Any) -> None:
    db = dbm.connect(f"sqlite:///{tmp_path / 'fuzz.db'}")
    dbm.migrate(db)
    store = Store(db)
    real = SyntheticEngine(engine_id="real", run_id="real-run", seed=1, max_token_budget=2048)
    attacker = SyntheticEngine(engine_id="fuzz", run_id="fuzz-run", seed=2)
    info_real, info_fuzz = store.apply([Hello(real.hello()), Hello(attacker.hello())])
    assert isinstance(info_real, RunInfo) and isinstance(info_fuzz, RunInfo)
    sent: list[dict[str, Any]] = []
    expected = {"fuzz": 1}

    @settings(FUZZ, max_examples=120)
    @given(seed=st.integers(0, 2**32 - 1))
    def attack(seed: int) -> None:
        rng = random.Random(seed)
        ops: list[Any] = []
        for _ in range(4):
            msg, _ = ingest.parse(rng_frame(rng, expected["fuzz"]))
            if msg is None:
                continue
            v = ingest.frame(msg, engine_id="fuzz", run_id="fuzz-run", expected=expected["fuzz"])
            if v.accepted:
                ops.append(Events(info_fuzz.run_key, v.accepted))
                expected["fuzz"] = v.expected
        batch = real.steps(1)  # the real engine goes on, in the same transactions
        ops.append(Events(info_real.run_key, batch))
        results = store.apply(ops)  # one bad value never fails the batch: never raises
        assert all(isinstance(r, EventsResult) for r in results)
        assert not results[-1].bad, results[-1].bad
        sent.extend(batch)

    attack()
    _int_columns_in_range(db)
    with db.connect() as c:
        n_steps = c.execute(
            select(func.count()).where(schema.steps.c.run_key == info_real.run_key)
        ).scalar_one()
        last_seq = c.execute(
            select(schema.runs.c.last_seq).where(schema.runs.c.id == info_real.run_key)
        ).scalar_one()
        for table in (schema.steps, schema.request_events, schema.gaps):
            dupes = c.execute(
                select(table.c.run_key, table.c.seq).group_by(table.c.run_key, table.c.seq)
                .having(func.count() > 1)
            ).all()  # fmt: skip
            assert dupes == []
    assert n_steps == sum(e["type"] == "step" for e in sent)
    assert last_seq == sent[-1]["seq"]
    store.close()
    db.dispose()


control_messages = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "type": st.just("control"),
            "engine_id": st.sampled_from(["real", "nobody"]) | json_values,
        },
        optional={
            "id": json_values,
            "run_id": json_values,
            "set": st.dictionaries(
                st.sampled_from(["token_budget", "policy", "long_prefill_token_threshold"])
                | st.text(max_size=6),
                json_values,
                max_size=4,
            )
            | json_values,
            "token": json_values,
        },
    ),
    st.fixed_dictionaries({"type": st.just("list_engines")}, optional={"offset": json_values}),
)


def _check_control(text: str) -> None:
    checked, why = ingest.check_control_message(text)
    if checked is None:
        assert why
        return
    try:
        changes = check_changes(checked.get("set"), 2048)
    except ControlRefused as exc:
        assert exc.reason
        row = ingest.control_refusal_row(checked, exc.param, known_engine=True)
        assert row is None or len(row) == 2  # one row at most per refused message
        return
    strict_json.loads(json.dumps(changes))  # accepted changes are plain, finite JSON


def rng_control(rng: random.Random) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "control", "engine_id": rng.choice(["real", "nobody"])}
    changes = {
        rng.choice(["token_budget", "policy", "long_prefill_token_threshold", "x"]): (
            rng.choice([rng.randint(-5, 5000), "chunked", "unchunked"])
            if rng.random() < 0.6
            else nasty(rng)
        )
        for _ in range(rng.randint(0, 3))
    }
    msg["set"] = changes if rng.random() < 0.9 else nasty(rng)
    for key in ("id", "run_id", "token", "engine_id"):
        if rng.random() < 0.1:
            msg[key] = nasty(rng)
    return msg


@settings(FUZZ, max_examples=80)
@given(msg=control_messages)
def test_the_control_rule_on_generated_messages(msg: Any) -> None:
    _check_control(_text(msg))


@settings(FUZZ, max_examples=40)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_control_rule_on_thousands_of_mutated_messages(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):  # 2,000 messages in all
        _check_control(json.dumps(rng_control(rng)))


def test_control_relay_fuzz_over_a_socket_keeps_the_real_engine(tmp_path: Any) -> None:
    """Random and mutated control messages on /control while a real engine publishes: every
    message gets an answer, the engine applies only valid changes, and its run is intact."""
    url = f"sqlite:///{tmp_path / 'relay.db'}"
    with collector_in_thread(url) as collector:
        eng = SyntheticEngine(engine_id="real", run_id="real-run", seed=3, max_token_budget=2048)
        client = FakeEngineClient(collector.url, eng)
        client.connect()
        with connect(collector.url + "/control", open_timeout=10, proxy=None) as ws:
            rng = random.Random(18)
            for n in range(150):
                msg = rng_control(rng)
                msg["id"] = f"fuzz-{n}"  # distinct ids: one answer each
                ws.send(json.dumps(msg))
                reply = json.loads(ws.recv(timeout=20))
                assert reply.get("type") in ("control_ack", "error"), reply
                if reply["type"] == "control_ack" and reply.get("ok"):
                    check_changes(msg["set"], 2048)  # only a valid change was applied
                    assert msg["engine_id"] == "real"
        client.send_events(eng.steps(3))
        assert client.wait_ack(eng.seq) == eng.seq  # the real run still publishes
        assert 1 <= eng.token_budget <= 2048
        client.close()
    db = dbm.connect(url, readonly=True)
    try:
        _int_columns_in_range(db)
        with db.connect() as c:
            rows = c.execute(select(func.count()).select_from(schema.controls)).scalar_one()
        assert rows <= 150  # one row at most per message
    finally:
        db.dispose()
