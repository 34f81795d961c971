"""A failover list of collectors: malformed lists refused at start-up; two collectors on one
PostgreSQL store, the first SIGKILLed mid-run, the publisher moves on to the second and every
seq is stored exactly once."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from engine.telemetry import Publisher, collector_urls
from storage import queries, schema
from storage.db import connect
from testkit.collector import start_collector
from testkit.engines import SyntheticEngine
from testkit.postgres import PostgresServer

WAIT_S = 30.0


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("ws://127.0.0.1:8765,ws://127.0.0.1:x", "2 of 2"),
        ("ws://127.0.0.1:8765,,ws://127.0.0.1:8766", "2 of 3"),
        ("http://127.0.0.1:8765,ws://127.0.0.1:8766", "1 of 2"),
        ("ws://127.0.0.1:99999", "1 of 1"),
    ],
)
def test_a_malformed_element_is_refused_by_name(text: str, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        collector_urls(text)
    with pytest.raises(ValueError, match=bad):
        Publisher(text, engine_id="e", hello=dict)


def test_a_list_is_normalized_in_order_without_repeats() -> None:
    got = collector_urls(" ws://127.0.0.1:1 , ws://h:2/ingest,ws://127.0.0.1:1")
    assert got == ["ws://127.0.0.1:1/ingest", "ws://h:2/ingest"]


def test_engine_and_vllm_launcher_refuse_a_malformed_list(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from chunkscope.integrations.vllm_launch import build_command
    from engine.server.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--collector-url", "ws://127.0.0.1:8765,ws://127.0.0.1:port"])
    assert info.value.code == 2
    assert "collector URL 2 of 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 of 2"):
        build_command(["--collector-url", "ws://a:1,wss://b:c", "--", "--model", "m"])
    given = ["--python", "/bin/true", "--collector-url", "ws://a:1, ws://b:2"]
    _, env = build_command([*given, "--", "--model", "m"])
    assert env["CHUNKSCOPE_COLLECTOR_URL"] == "ws://a:1/ingest,ws://b:2/ingest"


def _publish(pub: Publisher, events: list[dict[str, Any]]) -> None:
    for ev in events:
        pub.publish({k: v for k, v in ev.items() if k != "seq"})


def test_sigkilled_collector_fails_over_to_the_next_exactly_once(
    pg_server: PostgresServer,
) -> None:
    db_url = pg_server.create_database()
    first = start_collector(db_url)
    second = start_collector(db_url)
    syn = SyntheticEngine(engine_id="eng-fo", run_id="run-fo-1", seed=5)
    fields = {k: v for k, v in syn.hello().items() if k not in ("engine_id", "run_id")}
    pub = Publisher(
        f"{first.url},{second.url}",
        engine_id=syn.engine_id,
        run_id=syn.run_id,
        hello=lambda: fields,
        linger_s=0.01,
        backoff_initial_s=0.05,
        backoff_max_s=0.5,
    ).start()
    try:
        _publish(pub, syn.steps(150))
        assert pub.wait_acked(timeout=WAIT_S)
        assert pub.url == first.url + "/ingest"
        # events the first collector may or may not have stored when it dies
        _publish(pub, syn.steps(50))
        first.kill()
        _publish(pub, syn.steps(200))
        assert pub.wait_acked(timeout=WAIT_S), pub.stats()
        assert pub.url == second.url + "/ingest"
        last = pub.stats().last_seq
        pub.close(timeout=WAIT_S)
    finally:
        first.stop()
        second.stop()
    db = connect(db_url, readonly=True)
    steps = queries.steps(db, engine_id="eng-fo")
    assert list(steps["step"]) == list(range(400))
    with db.connect() as conn:
        run = conn.execute(select(schema.runs.c.last_seq, schema.runs.c.ended)).one()
        n = sum(
            conn.execute(select(func.count()).select_from(t)).scalar_one()
            for t in (schema.steps, schema.request_events, schema.gaps)
        )
    assert run.last_seq == last + 1 and run.ended is not None  # + the goodbye
    assert n == last  # every seq once: steps, request events (no gaps, no controls here)
