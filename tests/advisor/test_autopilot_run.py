"""What the autopilot process reads from the store for one tick: the look-back's arrivals and the
backlog the engine is still working through (a burst that arrived before the look-back and has
no first token yet), and the observation its predictions are checked against, on a run
simulated with a known cost model and written as telemetry."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from advisor.autopilot import AutopilotSlo, Setting, predict_settings
from advisor.autopilot_run import (
    lookback_start,
    main,
    observed,
    prefill_progress,
    recent_traffic,
    tick_wait_s,
)
from advisor.fit import FitReport
from advisor.simulate import EngineShape, SimRequest, SimResult, cost_model_step_ns, simulate
from advisor.traffic import Traffic
from engine.core.cost_model import CostModel
from storage import db as dbm
from tests.advisor.helpers import store_run

COST = CostModel(const=2e-3, prefill=1e-3, decode=1e-3, attn=0.0)  # 1 ms a token: slow
SHAPE = EngineShape(num_kv_blocks=2000, block_size=16, max_num_seqs=64, max_token_budget=4096)


def test_backlog_counts_as_arriving_at_the_window_start(tmp_path: Path) -> None:
    # a burst of 8 prompts of 500 tokens at t=0 (4 s of prefill at 1 ms a token, budget 256),
    # then one chat request at 3.0 s
    burst = [
        SimRequest(f"b{i}", 500_000, tuple(i * 100_000 + p for p in range(500)), 4, "rag")
        for i in range(8)
    ]
    chat = SimRequest("c0", 3_000_500_000, tuple(900_000 + p for p in range(20)), 4, "chat")
    reqs = [*burst, chat]
    res = simulate(
        reqs, SHAPE, token_budget=256, step_ns=cost_model_step_ns(COST.predict), gap_ns=0,
        record_steps=True,
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    wall_ns = store_run(url, reqs, res, SHAPE, engine_id="e")
    first = {o.request_id: (o.token_times_ns[0]) / 1e9 for o in res.requests}
    db = dbm.connect(url, readonly=True)
    t0 = wall_ns / 1e9
    since, until = t0 + 2.0, t0 + 3.5
    tr = recent_traffic(db, engine_id="e", run_id=None, since=since, until=until)
    got = {r.request_id: r for r in tr.requests}
    waiting = {rid for rid, f in first.items() if rid.startswith("b") and f > 2.0}
    served = {rid for rid, f in first.items() if rid.startswith("b") and f <= 2.0}
    assert waiting and served  # the window starts in the middle of the burst
    assert set(got) == waiting | {"c0"}
    assert all(abs(got[r].arrival - since) < 1e-6 for r in waiting)
    assert abs(got["c0"].arrival - (t0 + 3.0005)) < 1e-3
    assert got["b7"].num_prompt_tokens == 500
    db.dispose()


def _burst_run(tmp_path: Path) -> tuple[str, float, SimResult]:
    """8 prompts of 500 tokens at t=0 and a chat request at 3.0 s, budget 256, 1 ms a token,
    stored: (store URL, the run's wall start in seconds, the simulation)."""
    burst = [
        SimRequest(f"b{i}", 500_000, tuple(i * 100_000 + p for p in range(500)), 4, "rag")
        for i in range(8)
    ]
    chat = SimRequest("c0", 3_000_500_000, tuple(900_000 + p for p in range(20)), 4, "chat")
    res = simulate(
        [*burst, chat], SHAPE, token_budget=256, step_ns=cost_model_step_ns(COST.predict),
        gap_ns=0, record_steps=True,
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    wall_ns = store_run(url, [*burst, chat], res, SHAPE, engine_id="e")
    return url, wall_ns / 1e9, res


def test_the_window_starts_where_the_engine_was_between_steps(tmp_path: Path) -> None:
    # a replay starts from an idle engine: a look-back that begins inside a step begins at
    # that step's start instead (before any step, it stays where it is)
    url, t0, res = _burst_run(tmp_path)
    db = dbm.connect(url, readonly=True)
    mid = next(s for s in res.steps if s.end_ns - s.start_ns > 100_000_000)  # a 256-token step
    inside = t0 + (mid.start_ns + mid.end_ns) / 2e9
    assert lookback_start(db, engine_id="e", run_id=None, since=inside) == pytest.approx(
        t0 + mid.start_ns / 1e9, abs=1e-6
    )
    assert lookback_start(db, engine_id="e", run_id=None, since=t0 - 5.0) == t0 - 5.0
    db.dispose()


def test_the_backlog_is_replayed_from_where_its_prefill_had_got(tmp_path: Path) -> None:
    # the look-back starts in the middle of the burst (b3 has 285 of its 500 tokens done): the
    # requests being prefilled then carry their progress, so the replay (exact here: no
    # scatter) reproduces the TTFT the store saw; replayed from their first prompt token, every
    # later request would wait for b3's 272 tokens (whole blocks) again, 1 ms each
    url, t0, res = _burst_run(tmp_path)
    db = dbm.connect(url, readonly=True)
    since = lookback_start(db, engine_id="e", run_id=None, since=t0 + 2.0)
    until = t0 + 6.0  # the whole burst served
    done_ns = round((since - t0) * 1e9)
    expect: dict[str, int] = {}
    for s in res.steps:
        if s.end_ns <= done_ns:
            for ch in s.chunks:
                if ch.kind == "prefill":
                    expect[ch.request_id] = ch.start + ch.num_tokens
    tr = recent_traffic(db, engine_id="e", run_id=None, since=since, until=until)
    got = {r.request_id: r.num_computed_tokens for r in tr.requests}
    started = {rid: n for rid, n in expect.items() if rid in got}
    assert any(0 < n < 500 for n in started.values())  # one was mid-prefill
    assert {rid: got[rid] for rid in started} == started
    assert prefill_progress(db, engine_id="e", run_id=None, request_ids=set(), until=until) == {}
    obs = observed(db, engine_id="e", run_id=None, since=since, until=until, steady=True)
    report = FitReport(COST, 500, 0.0, 0.0)
    slo = AutopilotSlo(itl_ms=1000.0, ttft_ms=3000.0)
    [pred] = predict_settings(report, tr, SHAPE, [Setting(256)], slo)
    assert obs.ttft_p99_ms is not None and pred.ttft_seen_p99_ms is not None
    assert pred.ttft_seen_p99_ms == pytest.approx(obs.ttft_p99_ms, rel=0.05)
    fresh = Traffic([replace(r, num_computed_tokens=0) for r in tr.requests], tr.since, tr.until)
    [redo] = predict_settings(report, fresh, SHAPE, [Setting(256)], slo)
    assert redo.ttft_seen_p99_ms is not None
    assert redo.ttft_seen_p99_ms > obs.ttft_p99_ms + 250.0
    db.dispose()


def test_the_check_compares_what_the_store_can_have_seen(tmp_path: Path) -> None:
    # the window ends mid-burst: most of the burst still waits. The prediction's "seen" figures
    # (TTFT cut at the window's end, gaps so far) match the store's observation of the same
    # requests; its full TTFT p99 (requests served after the window) is far above both, which
    # is what made predictions and observations "part" in a burst before.
    burst = [
        SimRequest(f"b{i}", 500_000, tuple(i * 100_000 + p for p in range(500)), 4, "rag")
        for i in range(8)
    ]
    res = simulate(
        burst, SHAPE, token_budget=256, step_ns=cost_model_step_ns(COST.predict), gap_ns=0,
        record_steps=True,
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    wall_ns = store_run(url, burst, res, SHAPE, engine_id="e")
    db = dbm.connect(url, readonly=True)
    since, until = wall_ns / 1e9, wall_ns / 1e9 + 2.5
    tr = recent_traffic(db, engine_id="e", run_id=None, since=since, until=until)
    obs = observed(db, engine_id="e", run_id=None, since=since, until=until, steady=True)
    report = FitReport(COST, 500, 0.0, 0.0)
    slo = AutopilotSlo(itl_ms=1000.0, ttft_ms=3000.0)
    [pred] = predict_settings(report, tr, SHAPE, [Setting(256)], slo)
    assert pred.ttft_p99_ms is not None and pred.ttft_seen_p99_ms is not None
    assert obs.ttft_p99_ms is not None
    assert pred.ttft_seen_p99_ms == pytest.approx(obs.ttft_p99_ms, rel=0.05)
    assert pred.ttft_p99_ms > 1.4 * obs.ttft_p99_ms
    assert obs.ttft_p99_ms <= 2500.0 + 1.0
    db.dispose()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--probe-tokens", "-1", "--probe-tokens must be >= 0, got -1"),
        ("--interval", "0", "--interval must be positive, got 0.0"),
        ("--max-cpu-share", "0", "--max-cpu-share must be in (0, 1], got 0.0"),
        ("--max-cpu-share", "1.5", "--max-cpu-share must be in (0, 1], got 1.5"),
        ("--noise-window", "-1", "--noise-window must be >= 0, got -1.0"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_contacted(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--collector", "ws://127.0.0.1:9", "--engine", "e", "--db", "sqlite://",
            "--slo-itl-ms", "250", "--slo-ttft-ms", "2000", flag, value]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_costly_tick_spaces_out_the_next_within_its_cpu_share() -> None:
    # quiet traffic: a tick of 50 ms CPU keeps the interval; a burst's 0.7 s tick at a share of
    # 0.2 of a core waits 3.5 s, so the autopilot takes at most a fifth of a core from the engine
    assert tick_wait_s(1.0, 0.05, 0.2) == 1.0
    assert tick_wait_s(1.0, 0.7, 0.2) == pytest.approx(3.5)
    assert tick_wait_s(2.0, 0.7, 1.0) == 2.0


def test_recent_scatter_is_redrawn_at_most_every_few_seconds_per_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import advisor.autopilot_run as run
    from advisor.fit import fit_from_store
    from tests.advisor.helpers import random_requests

    reqs = random_requests(1, 60, prompt=(20, 400), output=(5, 30), spacing_ms=(50, 300))
    res = simulate(
        reqs, SHAPE, token_budget=256, step_ns=cost_model_step_ns(COST.predict),
        gap_ns=100_000, record_steps=True,
    )  # fmt: skip
    url = f"sqlite:///{tmp_path / 's.db'}"
    wall0 = store_run(url, reqs, res, SHAPE, engine_id="e") / 1e9
    end = wall0 + res.end_ns / 1e9
    db = dbm.connect(url, readonly=True)
    reads: list[float] = []
    real = run.load_steps

    def counted(*a: object, **kw: float) -> object:
        reads.append(kw["until"])
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(run, "load_steps", counted)
    runner = run.Runner.__new__(run.Runner)  # no collector: only what the scatter needs
    runner.opts = run.Options(collector="", engine_id="e", db_url=url, slo=AutopilotSlo(250, 2000))
    runner.db, runner.run_id, runner._noise_at = db, None, None
    fit = fit_from_store(db, engine_id="e", since=wall0, until=end, resamples=0)
    drawn, n = runner._recent_noise(fit, end)
    assert n >= 50 and drawn is not fit and drawn.model == fit.model  # (the scatter: test_noise)
    assert runner._recent_noise(fit, end + 4.9) == (drawn, n) and len(reads) == 1  # held
    runner._recent_noise(fit, end + 5.0)  # redrawn after NOISE_REFRESH_S
    refit = fit_from_store(db, engine_id="e", since=wall0, until=end, resamples=0)
    runner._recent_noise(refit, end + 5.1)  # and for another fit at once
    assert reads == [end, end + 5.0, end + 5.1]
    assert runner._recent_noise("poor fit", end) == ("poor fit", 0)
    runner.opts.noise_window_s = 0.0  # off: the fit window's scatter
    assert runner._recent_noise(fit, end + 20) == (fit, 0) and len(reads) == 3
