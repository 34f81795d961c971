"""A vLLM fleet into one collector on PostgreSQL: vLLM-CPU started with ``--data-parallel-size 2``
runs one engine core (and one scheduler) per rank; with the bridge each rank reports as its own
engine (``<engine id>-dp<rank>``, its rank in the hello), with its own run, steps and requests,
and the collector's control route reaches one rank without touching the other.

Skipped without the vLLM venv or PostgreSQL binaries (failed instead when
``CHUNKSCOPE_REQUIRE_VLLM=1`` / ``CHUNKSCOPE_REQUIRE_POSTGRES=1``)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest
from sqlalchemy import select

from storage import queries, schema
from storage.control import list_engines, send_control
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector
from tests.chunkscope.integrations.vllm_helpers import VllmServer, build_llama_folder, vllm_python

pytestmark = pytest.mark.slow

ENGINE_ID = "vllm-fleet"
RANKS = (f"{ENGINE_ID}-dp0", f"{ENGINE_ID}-dp1")
BUDGET = 256
WAIT_S = 90.0


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    from testkit.postgres import PostgresServer, PostgresUnavailable

    try:
        server = PostgresServer.start()
    except PostgresUnavailable as exc:
        if os.environ.get("CHUNKSCOPE_REQUIRE_POSTGRES") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        yield server.create_database()
    finally:
        server.stop()


class Fleet:
    def __init__(self, tmp: Path, py: Path, db_url: str) -> None:
        self.db_url = db_url
        self.collector: CollectorProcess = start_collector(db_url)
        model = build_llama_folder(tmp / "tiny-llama")
        try:
            self.vllm = VllmServer(
                py, model, "--data-parallel-size", "2", "--max-num-batched-tokens", str(BUDGET),
                "--kv-cache-memory-bytes", str(32 << 20), "--shutdown-timeout", "5",
                env={"CHUNKSCOPE_COLLECTOR_URL": self.collector.url,
                     "CHUNKSCOPE_ENGINE_ID": ENGINE_ID},
                log=tmp / "vllm.log",
            )  # fmt: skip
        except Exception:
            self.collector.stop()
            raise
        self.db = connect(db_url)

    def complete(self, prompt: str, max_tokens: int) -> str:
        """One streamed completion; the id its client saw."""
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        rid = None
        with httpx.stream(
            "POST", self.vllm.url + "/v1/completions", json=body, timeout=WAIT_S
        ) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and rid is None:
                    rid = json.loads(line[6:])["id"]
        assert rid is not None
        return rid

    def burst(self, prompts: list[tuple[str, int]]) -> list[str]:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(*p), prompts))

    def finished(self, ids: list[str]) -> pd.DataFrame:
        """The stored requests of ``ids`` (all engines), once every one has finished."""
        deadline = time.monotonic() + WAIT_S
        while True:
            reqs = queries.requests(self.db)
            got = reqs[reqs.request_id.isin(ids) & reqs.finished.notna()]
            if len(got) == len(ids) or time.monotonic() > deadline:
                assert sorted(got.request_id) == sorted(ids)
                return got
            time.sleep(0.3)

    def hellos(self) -> dict[str, dict[str, Any]]:
        r = schema.runs
        with self.db.connect() as conn:
            rows = conn.execute(select(r.c.engine_id, r.c.hello)).all()
        return {e: json.loads(h) for e, h in rows}

    def close(self) -> None:
        self.vllm.stop()
        self.collector.stop()


@pytest.fixture(scope="module")
def fleet(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    py = vllm_python()
    if py is None:
        msg = "no vLLM environment: run scripts/setup_vllm.sh"
        if os.environ.get("CHUNKSCOPE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    f = Fleet(tmp_path_factory.mktemp("vllm-fleet"), py, pg_url)
    try:
        yield f
    finally:
        f.close()


def _prompt(salt: int, n_words: int) -> str:
    words = "a small cat sleeps on a warm mat while the quick brown fox jumps".split()
    return " ".join(
        [words[salt % len(words)]] * (salt % 5 + 1) + [words[i % 14] for i in range(n_words)]
    )


def test_each_rank_reports_as_its_own_engine(fleet: Fleet) -> None:
    assert fleet.db_url.startswith("postgresql")
    ids = fleet.burst([(_prompt(k, 30 + 7 * k), 6 + k) for k in range(8)])
    reqs = fleet.finished(ids)
    hellos = fleet.hellos()
    assert set(hellos) == set(RANKS)
    for rank, eid in enumerate(RANKS):
        h = hellos[eid]
        # a dense model's ranks are independent engines in vLLM: each core knows its rank, not
        # the size (vLLM resets it to 1 there)
        assert (h["engine_kind"], h["data_parallel_rank"], h["data_parallel_size"]) == (
            "vllm",
            rank,
            None,
        )
    engines = queries.engines(fleet.db)
    assert set(engines.engine_id) == set(RANKS) and engines.run_id.nunique() == 2
    per_engine = {eid: set(reqs[reqs.engine_id == eid].request_id) for eid in RANKS}
    # vLLM's balancer spread the burst: each rank ran some, none ran a request twice
    assert all(per_engine.values()), per_engine
    assert per_engine[RANKS[0]].isdisjoint(per_engine[RANKS[1]])
    assert per_engine[RANKS[0]] | per_engine[RANKS[1]] == set(ids)
    for eid in RANKS:
        steps = queries.steps(fleet.db, engine_id=eid)
        assert list(steps.step) == list(range(1, len(steps) + 1)), eid
        chunks = queries.step_chunks(fleet.db, engine_id=eid, step_from=1, step_to=10**9)
        # a rank's steps carry only its own requests, and all of their tokens
        assert set(chunks.request_id) <= per_engine[eid] | set(
            queries.requests(fleet.db, engine_id=eid).request_id
        )
        mine = reqs[reqs.engine_id == eid].set_index("request_id")
        assert set(mine.index) <= set(chunks.request_id)
        produced = chunks.groupby("request_id").num_tokens.sum()
        for rid, row in mine.iterrows():
            want = row.num_prompt_tokens - row.num_cached_tokens + row.num_output_tokens - 1
            assert produced[rid] == want, (eid, rid)


def test_the_control_route_reaches_one_rank(fleet: Fleet) -> None:
    deadline = time.monotonic() + 30
    while True:
        seen = {e["engine_id"]: e for e in list_engines(fleet.collector.url)}
        if all(seen.get(e, {}).get("connected") for e in RANKS) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(seen[e]["connected"] for e in RANKS)
    ack = send_control(fleet.collector.url, RANKS[1], {"token_budget": 64})
    assert ack["ok"] and ack["old"] == {"token_budget": BUDGET}, ack
    at = int(ack["applied_at_step"])
    seen = {e["engine_id"]: e for e in list_engines(fleet.collector.url)}
    assert (seen[RANKS[0]]["token_budget"], seen[RANKS[1]]["token_budget"]) == (BUDGET, 64)
    refused = send_control(fleet.collector.url, RANKS[0], {"token_budget": BUDGET + 1})
    assert not refused["ok"]
    # long prompts to both ranks: rank 1 prefills in chunks of 64 from the answered step on,
    # rank 0 still takes up to 256
    ids = fleet.burst([(_prompt(100 + k, 400), 2) for k in range(6)])
    reqs = fleet.finished(ids)
    assert set(reqs.engine_id) == set(RANKS), "the balancer sent every request to one rank"
    for eid, budget in zip(RANKS, (BUDGET, 64), strict=True):
        steps = queries.steps(fleet.db, engine_id=eid)
        later = steps[steps.step >= (at if eid == RANKS[1] else 1)]
        assert (later.token_budget == budget).all(), eid
        assert later.num_scheduled_tokens.max() == budget, eid
    steps1 = queries.steps(fleet.db, engine_id=RANKS[1])
    assert (steps1[steps1.step < at].token_budget == BUDGET).all()
