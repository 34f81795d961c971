"""The fleet end to end: three collectors (processes) on one PostgreSQL store, six engines (the
real publisher, synthetic steps) spread over them with failover lists. A control through any
collector applies to every engine; one collector is SIGKILLed mid-run and its engines move on;
every engine's stored steps equal its own step counter, none doubled."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import func, select

from engine.telemetry import Publisher
from storage import queries, schema
from storage.control import list_engines, send_control
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector
from testkit.engines import SyntheticEngine
from testkit.postgres import PostgresServer

pytestmark = pytest.mark.slow

WAIT_S = 40.0


class Engine:
    """A synthetic engine publishing a step every few ms through the real publisher, taking
    budget controls as the engine does (answer with the step it applies at)."""

    def __init__(self, engine_id: str, urls: list[str], seed: int) -> None:
        self.syn = SyntheticEngine(engine_id=engine_id, run_id=f"run-{engine_id}", seed=seed)
        self.steps = 0
        self.budget = self.syn.token_budget
        self._lock = threading.Lock()
        fields = {k: v for k, v in self.syn.hello().items() if k not in ("engine_id", "run_id")}
        self.publisher = Publisher(
            ",".join(urls),
            engine_id=engine_id,
            run_id=self.syn.run_id,
            hello=lambda: {**fields, "token_budget": self.budget},
            apply_control=self._apply,
            linger_s=0.01,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _apply(self, changes: dict[str, Any], cid: str | None) -> dict[str, Any]:
        with self._lock:
            old, self.budget = self.budget, int(changes["token_budget"])
            return {"applied_at_step": self.steps, "old": {"token_budget": old}, "new": changes}

    def start(self) -> Engine:
        self.publisher.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            with self._lock:
                for ev in self.syn.steps(1):
                    self.publisher.publish({k: v for k, v in ev.items() if k != "seq"})
                self.steps += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.publisher.close(timeout=WAIT_S)


def _wait(cond: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            got = cond()
        except (OSError, RuntimeError):
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _where(url: str) -> dict[str, str]:
    """engine id -> the collector it is connected to, as ``url`` lists the fleet."""
    return {e["engine_id"]: e["collector"] for e in list_engines(url) if e.get("connected")}


def test_three_collectors_six_engines_one_killed(pg_server: PostgresServer) -> None:
    db_url = pg_server.create_database()
    collectors: list[CollectorProcess] = [start_collector(db_url) for _ in range(3)]
    urls = [c.url for c in collectors]
    engines = [
        Engine(f"eng-{i}", [urls[(i + k) % 3] for k in range(3)], seed=i).start() for i in range(6)
    ]
    try:
        # every collector lists the whole fleet, each engine on its first choice
        want = {f"eng-{i}": urls[i % 3] for i in range(6)}
        for url in urls:
            _wait(lambda url=url: _where(url) == want, f"{url} to list the fleet")
        # a control through a collector the engine is not connected to
        for i, eng in enumerate(engines):
            ack = send_control(urls[(i + 1) % 3], f"eng-{i}", {"token_budget": 100 + i})
            assert ack["ok"] is True, ack
            assert eng.budget == 100 + i
        collectors[0].kill()  # SIGKILL mid-run: eng-0 and eng-3 move to their next collector
        moved = {f"eng-{i}": urls[(i % 3) + 1 if i % 3 == 0 else i % 3] for i in range(6)}
        _wait(lambda: _where(urls[2]) == moved, "the fleet to settle after the kill")
        for i, eng in enumerate(engines):
            ack = send_control(urls[2 - i % 2], f"eng-{i}", {"token_budget": 200 + i})
            assert ack["ok"] is True, ack
            assert eng.budget == 200 + i
        time.sleep(0.5)  # more steps after the move
    finally:
        for eng in engines:
            eng.stop()
        for c in collectors:
            c.stop()
    db = connect(db_url, readonly=True)
    for eng in engines:
        steps = queries.steps(db, engine_id=eng.syn.engine_id)
        assert list(steps["step"]) == list(range(eng.steps)), eng.syn.engine_id
        stats = eng.publisher.stats()
        assert stats.acked_seq == stats.last_seq
    with db.connect() as conn:
        n = conn.execute(select(func.count()).select_from(schema.steps)).scalar_one()
    assert n == sum(e.steps for e in engines)  # none doubled
