"""The blame ledger on known runs: chat streams and long RAG prompts simulated through the
engine's own scheduler with a known cost model, written into a store as telemetry. The ledger
must split every gap into parts that add up, name the long prompt as the culprit of each stall,
blame queueing on the prompt that held the budget, and agree with the counterfactual: the same
traffic simulated without the long prompts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from advisor.blame import STALL_MIN_MS, BlameError, Ledger, Window
from advisor.blame_cli import main as blame_main
from advisor.blame_store import blame_request, blame_window
from advisor.simulate import EngineShape, SimRequest, SimResult, cost_model_step_ns, simulate
from engine.core.cost_model import CostModel
from storage import db as dbm
from tests.advisor.helpers import store_run

TRUE = CostModel(const=2e-3, prefill=50e-6, decode=300e-6, attn=2e-9)
GAP_NS = 400_000
SHAPE = EngineShape(num_kv_blocks=2000, block_size=16, max_num_seqs=64, max_token_budget=4096)
ENGINE = "engine-sim"


def _req(rid: str, t_ms: float, prompt: int, out: int, cls: str, base: int) -> SimRequest:
    ids = tuple(base + i for i in range(prompt))
    return SimRequest(rid, int(t_ms * 1e6) + 500_000, ids, out, cls)


def traffic() -> list[SimRequest]:
    """Four chat streams from the start, a 2,000-token RAG prompt at 100, 500 and 900 ms, and
    a short chat (the id a completion's client sees) arriving while the first one prefills."""
    reqs = [_req(f"chat-{i}", i, 20, 300, "chat", i * 10_000) for i in range(4)]
    reqs += [_req(f"rag-{j}", 100 + 400 * j, 2000, 2, "rag", 10**6 * (j + 1)) for j in range(3)]
    reqs.append(_req("cmpl-late", 110, 20, 10, "chat", 990_000))
    return reqs


def run(reqs: list[SimRequest], budget: int) -> SimResult:
    return simulate(
        reqs,
        SHAPE,
        token_budget=budget,
        step_ns=cost_model_step_ns(TRUE.predict),
        gap_ns=GAP_NS,
        record_steps=True,
    )


@pytest.fixture(scope="module", params=[4096, 512], ids=["budget4096", "budget512"])
def recorded(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    budget = int(request.param)
    reqs = traffic()
    result = run(reqs, budget)
    assert result.unfinished == 0
    url = f"sqlite:///{tmp_path_factory.mktemp('blame') / 'store.db'}"
    store_run(url, reqs, result, SHAPE, engine_id=ENGINE)
    db = dbm.connect(url, readonly=True)
    try:
        yield {"url": url, "db": db, "reqs": reqs, "result": result, "budget": budget}
    finally:
        db.dispose()


def _life_ms(result: SimResult) -> dict[str, float]:
    return {o.request_id: (o.token_times_ns[-1] - o.arrival_ns) / 1e6 for o in result.requests}


def test_parts_add_up_to_every_gap(recorded: dict[str, Any]) -> None:
    ledger = blame_window(recorded["db"], engine_id=ENGINE).ledger
    life = _life_ms(recorded["result"])
    for o in recorded["result"].requests:
        gaps = ledger.gaps(o.request_id)
        assert len(gaps) == len(o.token_times_ns)  # the TTFT and one gap per later token
        parts = gaps["own_ms"] + gaps["pause_ms"] + gaps["excess_ms"]
        np.testing.assert_allclose(parts, gaps["gap_ms"], rtol=0, atol=1e-6)
        assert (gaps[["own_ms", "pause_ms", "excess_ms", "queue_ms"]] >= -1e-9).all().all()
        # the gaps are the measured ones: their sum is arrival to last token
        assert gaps["gap_ms"].sum() == pytest.approx(life[o.request_id], abs=1e-3)
        out = ledger.request(o.request_id)
        assert sum(c["ms"] for c in out["culprits"]) == pytest.approx(out["excess_ms"], rel=1e-9)
        ms = [c["ms"] for c in out["culprits"]]
        assert ms == sorted(ms, reverse=True)


def test_the_long_prompt_is_the_culprit_of_every_chat_stall(recorded: dict[str, Any]) -> None:
    ledger = blame_window(recorded["db"], engine_id=ENGINE).ledger
    for i in range(4):
        gaps = ledger.gaps(f"chat-{i}")
        stalls = gaps[gaps["stall"]]
        assert len(stalls) >= 3  # each long prompt stalled each stream at least once
        assert stalls["culprit"].str.startswith("rag-").all()
        # the culprit took (nearly) all of the stall's excess: the other chats' decodes the rest
        assert (stalls["culprit_ms"] >= 0.9 * stalls["excess_ms"]).all()
        out = ledger.request(f"chat-{i}")
        top3 = {c["request_id"] for c in out["culprits"][:3]}
        assert top3 == {"rag-0", "rag-1", "rag-2"}
        # a 2,000-token prompt costs 100 ms of prefill plus its attention: about what it took
        pairs = 2000 * 2001 / 2
        want = 1e3 * (2000 * TRUE.prefill + pairs * TRUE.attn)
        for c in out["culprits"][:3]:
            assert want <= c["ms"] <= want * 1.1


def test_queueing_is_blamed_on_the_prompt_that_held_the_budget(recorded: dict[str, Any]) -> None:
    out, _ = blame_request(recorded["db"], engine_id=ENGINE, request_id="cmpl-late")
    top = out["culprits"][0]
    assert top["request_id"] == "rag-0"
    assert out["ttft_excess_ms"] > 0.9 * out["ttft_ms"] - 5  # it waited on the prompt
    if recorded["budget"] == 512:
        # the prompt's 512-token chunks took the whole budget: the short chat waited in the
        # queue, whole steps without a chunk, and the prompt is blamed for them
        assert out["queue_ms"] > 40
        assert top["queue_ms"] >= 0.95 * out["queue_ms"]
    else:
        # one step prefills it: the short chat arrived while it ran, it never queued a step
        assert out["queue_ms"] == pytest.approx(0.0, abs=1e-9)


def test_blame_matches_the_counterfactual(recorded: dict[str, Any]) -> None:
    """The same traffic without the long prompts: the chats' time saved is what the ledger
    blamed on them (exact step costs here, so within 1%)."""
    reqs = recorded["reqs"]
    without = run([r for r in reqs if not r.request_id.startswith("rag")], recorded["budget"])
    before, after = _life_ms(recorded["result"]), _life_ms(without)
    saved = sum(before[k] - after[k] for k in after)
    ledger = blame_window(recorded["db"], engine_id=ENGINE).ledger
    blamed = sum(
        c["ms"]
        for k in after
        for c in ledger.request(k)["culprits"]
        if c["request_id"].startswith("rag-")
    )
    assert saved > 1000
    assert blamed == pytest.approx(saved, rel=0.01)


def test_long_prompts_lead_the_offenders(recorded: dict[str, Any]) -> None:
    ledger = blame_window(recorded["db"], engine_id=ENGINE).ledger
    top = ledger.offenders(3)
    assert {o["request_id"] for o in top} == {"rag-0", "rag-1", "rag-2"}
    assert all(o["victims"] >= 4 and o["traffic_class"] == "rag" for o in top)
    assert all(o["num_prompt_tokens"] == 2000 for o in top)
    costs = ledger.costs()
    # every ms of excess is someone's cost
    assert costs["cost_to_others_ms"].sum() == pytest.approx(ledger.totals()["excess_ms"])
    classes = ledger.by_class().set_index("traffic_class")
    assert classes.loc["rag", "ms"] > classes.loc["chat", "ms"]
    assert classes["share"].sum() == pytest.approx(1.0)


def test_a_quiet_window_blames_almost_nothing(recorded: dict[str, Any]) -> None:
    """Between the long prompts only the chat decodes share the steps: no gap is a stall and
    each gap's excess is the other streams' decode tokens."""
    steps = pd.DataFrame(
        [(s.step, s.start_ns, s.end_ns) for s in recorded["result"].steps],
        columns=["step", "start_ns", "end_ns"],
    )
    wall0 = pd.read_sql("select clock_wall_ns, clock_mono_ns from runs", recorded["db"]).iloc[0]
    to_wall = lambda t: (wall0["clock_wall_ns"] + t) / 1e9  # noqa: E731 - simulation ns -> wall
    # from 60 ms after the first prompt's last chunk to the second prompt's arrival
    rag = [s for s in recorded["result"].steps if any(c.request_id == "rag-0" for c in s.chunks)]
    lo = to_wall(rag[-1].end_ns + 60_000_000)
    hi = to_wall(500_000_000)
    assert hi - lo > 0.1 and not steps.empty
    ledger = blame_window(recorded["db"], engine_id=ENGINE, since=lo, until=hi).ledger
    for i in range(4):
        gaps = ledger.gaps(f"chat-{i}")
        assert not gaps["stall"].any()
        # three other decodes (plus their attention over a few hundred positions)
        assert gaps["excess_ms"].max() < 3 * 1e3 * TRUE.decode * 1.2 + STALL_MIN_MS / 10


# ---- the command ----------------------------------------------------------------------------


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = blame_main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_request_json(recorded: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--db", recorded["url"], "--engine", ENGINE]
    code, out, _ = _cli([*base, "--request", "chat-0", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["request_id"] == "chat-0" and doc["excess_ms"] > 0
    assert [c["request_id"] for c in doc["culprits"][:3]] == sorted(
        ["rag-0", "rag-1", "rag-2"],
        key=lambda r: -next(c["ms"] for c in doc["culprits"] if c["request_id"] == r),
    )
    ms = [c["ms"] for c in doc["culprits"]]
    assert ms == sorted(ms, reverse=True) and all("request_id" in c for c in doc["culprits"])
    # a chat completion's id (chatcmpl-X) finds the engine's request cmpl-X
    code, out, _ = _cli([*base, "--request", "chatcmpl-late", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["request_id"] == "chatcmpl-late" and doc["stored_request_id"] == "cmpl-late"
    assert doc["culprits"][0]["request_id"] == "rag-0"
    code, out, _ = _cli([*base, "--request", "chat-0"], capsys)
    assert code == 0 and "rag-" in out and "culprit" in out


def test_cli_top_json(recorded: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--db", recorded["url"], "--engine", ENGINE]
    code, out, _ = _cli([*base, "--top", "3", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    offenders = doc["offenders"]
    assert [o["request_id"][:4] for o in offenders] == ["rag-"] * 3
    cost = [o["cost_to_others_ms"] for o in offenders]
    assert cost == sorted(cost, reverse=True)
    assert all(o["victims"] >= 4 for o in offenders)
    code, out, _ = _cli([*base, "--top", "2"], capsys)
    assert code == 0 and "offender" in out and out.count("rag-") == 2


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--request", "cmpl-nobody"], "no request 'cmpl-nobody'"),
        (["--top", "0"], "--top must be at least 1"),
        (["--top", "3", "--since", "100", "--until", "50"], "--until after --since"),
        (["--top", "3", "--since", "100", "--until", "200"], "no step in the window"),
    ],
)
def test_cli_bad_input_is_a_clear_error(
    recorded: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    code, out, err = _cli(["--db", recorded["url"], "--engine", ENGINE, *args], capsys)
    assert code == 2 and out == ""
    assert says in err and "Traceback" not in err


def test_cli_bad_store_and_engine(
    tmp_path: Path, recorded: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(
        ["--db", f"sqlite:///{tmp_path / 'none.db'}", "--engine", "e", "--top", "1"], capsys
    )
    assert code == 2 and "no store at" in err
    code, _, err = _cli(["--db", recorded["url"], "--engine", "engine-x", "--top", "1"], capsys)
    assert code == 2 and "no engine 'engine-x'" in err


def test_chunkscope_blame_runs_as_a_command(recorded: dict[str, Any]) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [
        sys.executable,
        "-m",
        "chunkscope.cli",
        "blame",
        "--db",
        recorded["url"],
        "--engine",
        ENGINE,
    ]
    proc = subprocess.run(
        [*cmd, "--request", "nope"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "no request 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the parts add up, whatever the steps ------------------------------------------------


@st.composite
def windows(draw: st.DrawFn) -> Window:
    """Random steps (random durations and pauses, not what any model predicts) with random
    chunks of a few requests, arrivals inside or between steps."""
    n_req = draw(st.integers(1, 5))
    n_steps = draw(st.integers(1, 12))
    t = 1_000_000
    steps, chunks = [], []
    arrivals = [draw(st.integers(0, 3_000_000 * n_steps)) for _ in range(n_req)]
    for s in range(n_steps):
        t += draw(st.integers(0, 500_000))
        dur = draw(st.integers(1, 3_000_000))
        steps.append((s, t, t + dur))
        present = [r for r in range(n_req) if draw(st.booleans())] or [0]
        for r in present:
            kind = draw(st.sampled_from(["prefill", "decode"]))
            n = 1 if kind == "decode" else draw(st.integers(1, 300))
            chunks.append((s, f"r{r}", kind, draw(st.integers(0, 500)), n, draw(st.booleans())))
        t += dur
    sdf = pd.DataFrame(steps, columns=["step", "start_ns", "end_ns"])
    sdf["start"] = sdf["start_ns"] / 1e9 + 1.7e9
    cdf = pd.DataFrame(
        chunks, columns=["step", "request_id", "kind", "start", "num_tokens", "produced_token"]
    )
    rdf = pd.DataFrame(
        {
            "request_id": [f"r{r}" for r in range(n_req)],
            "traffic_class": ["chat"] * n_req,
            "num_prompt_tokens": [100] * n_req,
            "num_image_tokens": [0] * n_req,
            "arrival": [1.7e9 + (1_000_000 + a) / 1e9 for a in arrivals],
            "finished": [np.nan] * n_req,
        }
    )
    return Window("e", "r", sdf, cdf, rdf)


@settings(max_examples=30, deadline=None)
@given(windows())
def test_parts_always_add_up(window: Window) -> None:
    model = CostModel(const=1e-3, prefill=40e-6, decode=200e-6, attn=1e-9, multi_row=5e-4)
    ledger = Ledger(window, model)
    total_excess = 0.0
    for rid in ledger.ids:
        gaps = ledger.gaps(str(rid))
        if gaps.empty:
            continue
        parts = gaps["own_ms"] + gaps["pause_ms"] + gaps["excess_ms"]
        np.testing.assert_allclose(parts, gaps["gap_ms"], rtol=1e-9, atol=1e-6)
        out = ledger.request(str(rid))
        assert sum(c["ms"] for c in out["culprits"]) == pytest.approx(
            out["excess_ms"], rel=1e-9, abs=1e-9
        )
        total_excess += out["excess_ms"]
    assert ledger.costs()["cost_to_others_ms"].sum() == pytest.approx(total_excess, abs=1e-6)


def test_an_empty_window_is_refused() -> None:
    empty = pd.DataFrame(columns=["step", "start_ns", "end_ns", "start"])
    chunks = pd.DataFrame(
        columns=["step", "request_id", "kind", "start", "num_tokens", "produced_token"]
    )
    reqs = pd.DataFrame(columns=["request_id", "traffic_class", "num_prompt_tokens",
                                 "num_image_tokens", "arrival", "finished"])  # fmt: skip
    with pytest.raises(BlameError, match="no steps"):
        Ledger(Window("e", "r", empty, chunks, reqs), TRUE)


def test_the_simulators_counterfactual_agrees_with_the_ledger(recorded: dict[str, Any]) -> None:
    """Replaying the stored window through the scheduler with and without the long prompts
    predicts the gain the ledger blamed on them."""
    from advisor.blame_counterfactual import counterfactual

    blamed = blame_window(recorded["db"], engine_id=ENGINE)
    rags = ["rag-0", "rag-1", "rag-2"]
    cf = counterfactual(recorded["db"], blamed.ledger, rags, gap_s=GAP_NS / 1e9)
    assert cf.victims == 5 and cf.culprits == tuple(rags)
    assert cf.predicted_gain_ms > 1000
    assert cf.blamed_ms == pytest.approx(cf.predicted_gain_ms, rel=0.05)
    with pytest.raises(BlameError, match="not among"):
        counterfactual(recorded["db"], blamed.ledger, ["cmpl-nobody"])


def test_the_ledger_of_a_few_gaps_agrees_with_the_windows(recorded: dict[str, Any]) -> None:
    """``blame_tokens`` (the Live page's stalls) reads only the gaps before the tokens asked
    for: their excess and culprits are the whole window's."""
    from advisor.blame_store import blame_tokens, fit_recent
    from storage import queries

    db = recorded["db"]
    blamed = blame_window(db, engine_id=ENGINE)
    itl = queries.token_itl(db, engine_id=ENGINE)
    run_id = str(itl["run_id"].iloc[0])
    whole = blamed.ledger.gaps("chat-0").set_index("step")
    stalls = whole[whole["stall"]]
    tokens = itl[(itl["request_id"] == "chat-0") & itl["step"].isin(stalls.index)]
    assert len(tokens) == len(stalls) >= 3
    out = blame_tokens(
        db, engine_id=ENGINE, run_id=run_id, tokens=tokens, model=blamed.fit.model
    ).set_index("step")
    assert sorted(out.index) == sorted(stalls.index)
    np.testing.assert_allclose(out["excess_ms"], stalls.loc[out.index, "excess_ms"], rtol=1e-9)
    for step, row in out.iterrows():
        top, ms = row["culprits"][0]
        assert top == stalls.loc[step, "culprit"]
        assert ms == pytest.approx(stalls.loc[step, "culprit_ms"], rel=1e-9)
        assert row["classes"][row["culprits"][0][0]] == "rag"
        assert row["prompts"][row["culprits"][0][0]] == 2000
    # the model of the run's last minutes, for a window too short to fit on
    model = fit_recent(db, engine_id=ENGINE, run_id=run_id, until=float(itl["time"].max()))
    assert model.model.prefill == pytest.approx(TRUE.prefill, rel=0.2)
