"""The autopilot's decision on synthetic traffic and step costs (no store, no engine)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from typing import Any

import pytest

from advisor.autopilot import (
    Autopilot,
    AutopilotConfig,
    AutopilotSlo,
    Observed,
    Prediction,
    Setting,
    candidates,
    parse_reason,
    probe_extrapolated,
    probe_stall_ms,
    readiness,
    request_meets,
)
from advisor.fit import FitReport, NoiseModel
from advisor.overload import WindowLoad
from advisor.simulate import EngineShape
from advisor.traffic import ObservedRequest, Traffic
from engine.core.cost_model import CostModel, chunk_pairs

SHAPE = EngineShape(num_kv_blocks=4096, block_size=16, max_token_budget=16384)
SLO = AutopilotSlo(itl_ms=100.0, ttft_ms=3000.0)
GRID = (Setting(256), Setting(1024), Setting(16384))


def fit(noise: NoiseModel | None = None, r2: float = 0.99, steps: int = 500) -> FitReport:
    # 5 ms a step, 0.1 ms a prefill token, 0.5 ms a decode token: a 16k-token step is ~1.6 s
    model = CostModel(0.005, 1e-4, 5e-4, 0.0, num_steps=steps, rel_err_p50=0.05, r2=r2)
    return FitReport(model, steps, 0.0, 0.0, noise=noise)


def chat_and_rag(
    chat_rate: float, output: int, rag_every: float, seed: int = 0, seconds: float = 20.0
) -> Traffic:
    """Chat (64-token prompts, ``output`` tokens out) at ``chat_rate`` per second and a
    4000-token RAG prompt every ``rag_every`` seconds from 0.5 s."""
    rng = random.Random(seed)
    reqs, t, i = [], 0.0, 0
    while t < seconds:
        t += rng.expovariate(chat_rate)
        reqs.append(ObservedRequest(f"c{i}", "chat", t, 64, 0, 0, output))
        i += 1
    n_rag = int(seconds / rag_every)
    reqs += [
        ObservedRequest(f"r{k}", "rag", rag_every * k + 0.5, 4000, 0, 0, 20) for k in range(n_rag)
    ]
    reqs.sort(key=lambda r: r.arrival)
    return Traffic(reqs, 0.0, seconds)


def traffic(seed: int = 0, *, rag: bool = True, seconds: float = 20.0) -> Traffic:
    """Chat at 2/s (40 tokens out) and, with ``rag``, a RAG prompt every 2 s."""
    return chat_and_rag(2.0, 40, 2.0 if rag else math.inf, seed, seconds)


def pilot(start: Setting = GRID[2], slo: AutopilotSlo = SLO, **kw: object) -> Autopilot:
    return Autopilot(AutopilotConfig(candidates=GRID, start=start, **kw), slo)  # type: ignore[arg-type]


GENEROUS = AutopilotSlo(itl_ms=10_000.0, ttft_ms=60_000.0)  # every setting meets it


def test_picks_the_known_best_after_confirming() -> None:
    # At 16384 a RAG prompt is one ~0.4 s step that every chat gap waits for (ITL SLO 100 ms);
    # at 1024 a step is ~0.1 s plus decode; at 256 every request meets both SLOs. (A gain this
    # large moves at once by default: ``fast_margins`` out of reach here, to test ``confirm``.)
    ap = pilot(fast_margins=10_000)
    first = ap.decide(0.0, fit(), traffic(), SHAPE)
    assert first.kind == "hold" and first.setting == Setting(16384)
    assert "needs 2 ticks" in first.reason
    second = ap.decide(2.0, fit(), traffic(), SHAPE)
    assert second.kind == "change" and second.setting == Setting(256), second.reason
    assert second.chosen is not None and second.left is not None
    assert second.chosen.num_meet > second.left.num_meet
    itl, ttft = parse_reason(second.reason)
    assert itl == pytest.approx(round(second.chosen.itl_p99_ms or 0), abs=0.5)
    assert ttft == pytest.approx(round(second.chosen.ttft_p99_ms or 0), abs=0.5)
    assert "left budget 16384 cap off: predicted chat ITL p99" in second.reason


def burst() -> Traffic:
    """Chat at 4/s and a RAG prompt every second."""
    return chat_and_rag(4.0, 40, 1.0)


def long_chat() -> Traffic:
    """Chat streams of 200 tokens at 1/s and a RAG prompt every 5 s: a chat stream sees at
    most one RAG step, one gap in 199, which its p99 does not see."""
    return chat_and_rag(1.0, 200, 5.0)


def test_a_large_predicted_gain_moves_at_once() -> None:
    # a RAG prompt a second: at 16384 a fifth of the requests miss, a gain of many margins
    # (margin: 5% of the requests) is not noise, and waiting a tick costs a share of the burst
    ap = pilot()
    d = ap.decide(0.0, fit(), burst(), SHAPE)
    assert d.kind == "change" and d.setting == Setting(256), d.reason
    n = len(burst().requests)
    assert d.chosen is not None and d.left is not None
    assert d.chosen.num_meet - d.left.num_meet >= 3 * math.ceil(0.05 * n)
    # a gain of one margin (traffic(): 3 of 42) still waits for a second tick
    ap = pilot()
    first = ap.decide(0.0, fit(), traffic(), SHAPE)
    assert first.kind == "hold" and "needs 2 ticks" in first.reason, first.reason


def script_predictions(monkeypatch: pytest.MonkeyPatch, rounds: list[dict[int, int]]) -> None:
    """Each tick's predictions from ``rounds`` (requests meeting the SLOs of 50, per budget of
    GRID), instead of the simulator."""
    import advisor.autopilot as apm

    ticks = iter(rounds)

    def fake(*args: Any, **kw: object) -> list[Prediction]:
        met = next(ticks)
        return [Prediction(s, 50, met[s.budget], 5.0, 5.0, 100.0, 0) for s in args[3]]

    monkeypatch.setattr(apm, "predict_settings", fake)


def test_confirmation_counts_the_current_setting_beaten_not_one_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # two small budgets trade first place from one tick's draws to the next; both beat the
    # current 16384 by a margin (5 of ~50, under the 3-margin fast path) each time: the second
    # tick moves, to that tick's best
    rounds = [{256: 50, 1024: 46, 16384: 45}, {256: 46, 1024: 50, 16384: 45}]

    script_predictions(monkeypatch, rounds)
    ap = pilot(start=Setting(16384))
    first = ap.decide(0.0, fit(), traffic(), SHAPE)
    assert first.kind == "hold" and "needs 2 ticks" in first.reason, first.reason
    second = ap.decide(1.0, fit(), traffic(), SHAPE)
    assert second.kind == "change" and second.setting == Setting(1024), second.reason


def test_winners_on_both_sides_of_the_current_setting_do_not_confirm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # from 1024, a smaller budget wins one tick and a larger one the next: noise, not a trend
    # (a new user's small window flapped 256 -> 512 -> 256 in 5 s when these counted together)
    rounds = [{256: 50, 1024: 45, 16384: 44}] + [{256: 44, 1024: 45, 16384: 50}] * 2

    script_predictions(monkeypatch, rounds)
    ap = pilot(start=Setting(1024))
    assert ap.decide(0.0, fit(), traffic(), SHAPE).kind == "hold"
    assert ap.decide(1.0, fit(), traffic(), SHAPE).kind == "hold"  # the other side: count restarts
    third = ap.decide(2.0, fit(), traffic(), SHAPE)  # the same side twice: it moves
    assert third.kind == "change" and third.setting == Setting(16384), third.reason
    assert (
        Setting(256).side_of(Setting(1024)) == -1
        and Setting(1024, 256).side_of(Setting(1024)) == -1
    )
    assert Setting(16384).side_of(Setting(1024)) == 1 and Setting(1024).side_of(Setting(1024)) == 0


def test_a_tie_goes_to_the_setting_without_stalls() -> None:
    # Every setting meets the p99 and TTFT SLOs; at 16384 a chat stream's one gap behind a RAG
    # prompt (~0.4 s) is past the 100 ms ITL SLO, at 256 none is: the tie goes to 256, with
    # the margin and confirmation a gain in requests needs, and the reason says why
    ap = pilot(start=Setting(16384), slo=AutopilotSlo(itl_ms=100.0, ttft_ms=10_000.0))
    first = ap.decide(0.0, fit(), long_chat(), SHAPE)
    assert first.kind == "hold", first.reason
    by = {p.setting: p for p in first.predictions}
    assert by[Setting(256)].num_meet == by[Setting(16384)].num_meet
    assert (by[Setting(256)].num_meet_tail or 0) > (by[Setting(16384)].num_meet_tail or 0)
    d = ap.decide(1.0, fit(), long_chat(), SHAPE)
    assert d.kind == "change" and d.setting == Setting(256), d.reason
    assert "keep every token gap within 100 ms" in d.reason
    # the decision log is JSON lines: every figure a plain number (an numpy integer in a count
    # once killed the autopilot at its first logged tick)
    logged = json.loads(json.dumps(d.to_dict()))
    assert {p["num_meet_tail"] for p in logged["predictions"]} == {
        p.num_meet_tail for p in d.predictions
    }
    # an explicit tail SLO counts the stalls in num_meet itself: then it is a plain gain
    strict = AutopilotSlo(itl_ms=100.0, ttft_ms=10_000.0, tail_itl_ms=100.0)
    ap = pilot(start=Setting(16384), slo=strict, fast_margins=10_000)
    ap.decide(0.0, fit(), long_chat(), SHAPE)
    d = ap.decide(1.0, fit(), long_chat(), SHAPE)
    assert d.kind == "change" and "more of" in d.reason, d.reason


def test_does_not_flap_on_noise() -> None:
    # Quiet chat: every candidate meets the SLOs, and the step times scatter +-40% (a fresh
    # draw each tick, fresh arrivals each tick): the autopilot must stay where it is.
    ratios = [[0.6 + 0.8 * q / 199 for q in range(200)]]
    noise = NoiseModel([1.0], ratios, [0.0])
    ap = pilot(start=Setting(1024))
    kinds = []
    for tick in range(12):
        d = ap.decide(2.0 * tick, fit(noise), traffic(tick, rag=False), SHAPE)
        kinds.append(d.kind)
        ap.moved(d.setting, 2.0 * tick)
    assert kinds == ["hold"] * 12
    assert ap.current == Setting(1024)
    # RAG bursts under SLOs every setting meets: the settings differ (the tail), the count of
    # requests meeting the SLOs does not, and the scatter reorders their tails from tick to tick
    ap = pilot(start=Setting(1024), slo=GENEROUS)
    for tick in range(8):
        d = ap.decide(2.0 * tick, fit(noise), traffic(tick), SHAPE)
        assert d.kind == "hold", d.reason
        ap.moved(d.setting, 2.0 * tick)


def test_hysteresis_needs_a_margin() -> None:
    ap = pilot(start=Setting(16384), slo=GENEROUS, margin_frac=0.0, confirm=1)
    d = ap.decide(0.0, fit(), traffic(), SHAPE)
    assert d.kind == "hold", d.reason  # a gain of 0 requests is no reason to move
    assert d.predictions and len({p.itl_max_ms for p in d.predictions}) > 1  # tails differ


def test_falls_back_when_predictions_and_observations_part() -> None:
    bad = Observed(itl_p99_ms=900.0, ttft_p99_ms=9000.0, steady=True)
    # the third parted tick falls back to the operator's setting and says so
    ap2 = pilot(start=Setting(16384), part_ticks=3)
    ap2.moved(Setting(256), 0.0)
    out = [ap2.decide(10.0 + t, fit(), traffic(), SHAPE, bad) for t in range(3)]
    assert [o.kind for o in out[:2]] == ["hold", "hold"]
    assert out[2].kind == "fallback" and out[2].setting == Setting(16384)
    assert "parted" in out[2].reason and "operator's" in out[2].reason
    ap2.moved(out[2].setting, 12.0)
    held = ap2.decide(20.0, fit(), traffic(), SHAPE)
    assert held.kind == "fallback" and held.setting == Setting(16384)


def test_fallback_needs_parting_for_a_whole_span() -> None:
    # ticks a second apart replay nearly the same window: parting on three of them is one
    # noisy window; with part_span_s it must last that long, and a tick that agrees resets it
    bad = Observed(itl_p99_ms=900.0, ttft_p99_ms=9000.0, steady=True)
    ap = pilot(start=Setting(16384), part_ticks=3, part_span_s=10.0)
    ap.moved(Setting(256), 0.0)
    kinds = [ap.decide(10.0 + t, fit(), traffic(), SHAPE, bad).kind for t in range(5)]
    assert kinds == ["hold"] * 5  # parted for 4 s only
    d0 = ap.decide(15.0, fit(), traffic(), SHAPE)  # no observation: nothing parts
    ok = Observed(d0.left.itl_p99_ms, d0.left.ttft_p99_ms, steady=True)  # type: ignore[union-attr]
    assert ap.decide(16.0, fit(), traffic(), SHAPE, ok).kind == "hold"  # agrees: reset
    out = [ap.decide(17.0 + t, fit(), traffic(), SHAPE, bad) for t in range(11)]
    assert [o.kind for o in out[:10]] == ["hold"] * 10
    assert out[10].kind == "fallback" and "over 10 s" in out[10].reason


def test_no_fallback_when_predictions_part_within_the_slo() -> None:
    # quiet chat at 256: predicted ITL p99 a few ms, observed 90 ms and TTFT 2.5 s: far apart
    # but both within the SLOs (100 ms, 3 s), so model and measurement agree they hold: no
    # fallback (a fallback here once held the operator's setting through a whole burst)
    ap = pilot(start=Setting(16384), part_ticks=1)
    ap.moved(Setting(256), 0.0)
    d0 = ap.decide(10.0, fit(), traffic(rag=False), SHAPE)
    assert d0.left is not None and d0.left.itl_p99_ms is not None
    assert d0.left.itl_p99_ms < 15
    off = Observed(itl_p99_ms=90.0, ttft_p99_ms=2500.0, steady=True)
    for t in range(4):
        d = ap.decide(12.0 + t, fit(), traffic(t, rag=False), SHAPE, off)
        assert d.kind == "hold" and d.setting == Setting(256), d.reason


def test_no_fallback_when_predictions_hold() -> None:
    ap = pilot(start=Setting(16384), part_ticks=1)
    ap.moved(Setting(256), 0.0)
    d0 = ap.decide(10.0, fit(), traffic(), SHAPE)
    assert d0.left is not None
    good = Observed(d0.left.itl_p99_ms, d0.left.ttft_p99_ms, steady=True)
    assert ap.decide(12.0, fit(), traffic(), SHAPE, good).kind == "hold"


def test_refuses_on_a_poor_fit() -> None:
    d = pilot().decide(0.0, fit(r2=0.1), traffic(), SHAPE)
    assert d.kind == "refuse" and not d.changes and "poor fit" in d.reason


def test_makes_no_decision_from_an_overloaded_window() -> None:
    # the two ticks that would move 16384 -> 256 (test above), with the queue growing through
    # the window: no change, and the reason says why
    ap = pilot()
    grows = WindowLoad(arrived=20, queued_start=1, queued_end=12)
    for t in (0.0, 2.0, 4.0):
        d = ap.decide(t, fit(), traffic(), SHAPE, None, grows)
        assert d.kind == "refuse" and not d.changes, d.reason
        assert "overloaded" in d.reason and "queue grew from 1 to 12" in d.reason
    failed = WindowLoad(arrived=20, queued_start=0, queued_end=0, failed=2)
    assert "failed" in ap.decide(6.0, fit(), traffic(), SHAPE, None, failed).reason
    # a window that is not overloaded decides as before
    calm = WindowLoad(arrived=20, queued_start=1, queued_end=2)
    assert ap.decide(8.0, fit(), traffic(), SHAPE, None, calm).kind == "hold"
    assert ap.decide(10.0, fit(), traffic(), SHAPE, None, calm).kind == "change"


def test_from_an_overloaded_window_it_moves_only_to_more_prefill_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grows = WindowLoad(arrived=20, queued_start=1, queued_end=12)
    # at 256 the queue grows and 1024 is predicted to serve far more: it moves up at once
    script_predictions(monkeypatch, [{256: 30, 1024: 45, 16384: 40}])
    ap = pilot(start=Setting(256))
    d = ap.decide(0.0, fit(), traffic(), SHAPE, None, grows)
    assert d.kind == "change" and d.setting == Setting(1024), d.reason
    assert "overloaded" in d.reason and "only a move to more prefill per step" in d.reason
    assert parse_reason(d.reason) == (5.0, 100.0)
    # a smaller setting predicted best is not taken from an overloaded window (nor a readier)
    script_predictions(monkeypatch, [{256: 50, 1024: 40, 16384: 30}] * 3)
    ap = pilot(start=Setting(1024))
    for t in (0.0, 2.0):
        d = ap.decide(t, fit(), traffic(), SHAPE, None, grows)
        assert d.kind == "refuse" and not d.changes, d.reason
        assert "no setting with more prefill per step is predicted to meet more" in d.reason
    # once the window is calm, step 4 decides as before (256 gains 10 of 42: it moves at once)
    calm = WindowLoad(arrived=20, queued_start=1, queued_end=2)
    assert ap.decide(4.0, fit(), traffic(), SHAPE, None, calm).setting == Setting(256)
    # a small gain waits for a second tick, as it does from a calm window; the dwell holds too
    script_predictions(monkeypatch, [{256: 40, 1024: 43, 16384: 40}] * 3)
    ap = pilot(start=Setting(256))
    first = ap.decide(0.0, fit(), traffic(), SHAPE, None, grows)
    assert first.kind == "refuse" and "needs 2 ticks in a row" in first.reason, first.reason
    assert ap.decide(2.0, fit(), traffic(), SHAPE, None, grows).setting == Setting(1024)


def test_an_overloaded_window_simulates_only_the_settings_it_can_move_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the smaller settings cannot be chosen from an overloaded window, and a burst's queue is
    # costliest to replay at them: they are not simulated (a calm window simulates them all)
    import advisor.autopilot as apm

    asked: list[list[Setting]] = []
    real = apm.predict_settings

    def spy(*args: Any, **kw: Any) -> list[Prediction]:
        asked.append(list(args[3]))
        return real(*args, **kw)

    monkeypatch.setattr(apm, "predict_settings", spy)
    ap = pilot(start=Setting(1024))
    grows = WindowLoad(arrived=20, queued_start=1, queued_end=12)
    d = ap.decide(0.0, fit(), traffic(), SHAPE, None, grows)
    assert sorted(asked[-1]) == [Setting(1024), Setting(16384)], asked
    assert {p.setting for p in d.predictions} == {Setting(1024), Setting(16384)}
    ap.decide(2.0, fit(), traffic(), SHAPE, None, WindowLoad(20, 1, 2))
    assert sorted(asked[-1]) == sorted(GRID)


def test_an_overloaded_window_is_not_read_as_predictions_parting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # observed far from predicted on every tick, but the window is overloaded: its figures say
    # how long the queue was; no fallback to the operator's setting
    script_predictions(monkeypatch, [{256: 40, 1024: 40, 16384: 40}] * 4)
    ap = pilot(start=Setting(16384), part_ticks=1)
    ap.moved(Setting(1024), 0.0)
    grows = WindowLoad(arrived=20, queued_start=1, queued_end=12)
    far = Observed(itl_p99_ms=900.0, ttft_p99_ms=20_000.0, steady=True)
    for t in (10.0, 12.0, 14.0):
        d = ap.decide(t, fit(), traffic(), SHAPE, far, grows)
        assert d.kind == "refuse" and d.setting == Setting(1024), d.reason
    calm = WindowLoad(arrived=20, queued_start=1, queued_end=2)
    assert ap.decide(16.0, fit(), traffic(), SHAPE, far, calm).kind == "fallback"


def test_refuses_with_too_little_data() -> None:
    few = Traffic(traffic().requests[:3], 0.0, 20.0)
    d = pilot().decide(0.0, fit(), few, SHAPE)
    assert d.kind == "refuse" and "too little data" in d.reason
    d = pilot().decide(0.0, fit(steps=10), traffic(), SHAPE)
    assert d.kind == "refuse" and "10 steps" in d.reason
    d = pilot().decide(0.0, "need at least 4 steps", traffic(), SHAPE)
    assert d.kind == "refuse" and "too little data" in d.reason


def test_candidates_follow_what_the_engine_supports() -> None:
    got = candidates([256, 2048, 32768], [0, 512], max_token_budget=16384, cap_supported=True)
    assert got == [Setting(256), Setting(2048), Setting(2048, 512)]
    got = candidates([256, 2048], [0, 512], max_token_budget=None, cap_supported=False)
    assert got == [Setting(256), Setting(2048)]
    with pytest.raises(ValueError, match="no candidate"):
        candidates([32768], [0], max_token_budget=16384, cap_supported=True)


def test_request_meets_each_slo() -> None:
    slo = AutopilotSlo(itl_ms=50, ttft_ms=1000, tail_itl_ms=200, ttft_by_class={"rag": 5000})
    assert request_meets(0.5, [0.02] * 50, slo, "chat")
    assert not request_meets(None, [], slo, "chat")
    assert not request_meets(1.5, [0.02] * 50, slo, "chat")
    assert request_meets(1.5, [0.02] * 50, slo, "rag")
    assert not request_meets(0.5, [0.02] * 98 + [0.3], slo, "chat")  # the stall tail
    assert not request_meets(0.5, [0.06] * 50, slo, "chat")
    with pytest.raises(ValueError):
        AutopilotSlo(itl_ms=0, ttft_ms=100)


def test_image_steps_cost_the_fits_vision_term() -> None:
    """The autopilot simulates image requests as the advisor does: their prefill steps pay the
    fit's vision term (seconds per image token), so a slow encoder shows in the predicted TTFT."""
    from advisor.autopilot import predict_settings

    reqs = [ObservedRequest("c0", "chat", 0.1, 64, 0, 0, 20)]
    reqs += [ObservedRequest(f"v{k}", "vlm", 0.5 + k, 1300, 1196, 0, 10) for k in range(4)]
    images = Traffic(reqs, 0.0, 8.0)
    base = CostModel(0.005, 1e-4, 5e-4, 0.0, num_steps=500, rel_err_p50=0.05, r2=0.99)
    slow = CostModel(0.005, 1e-4, 5e-4, 0.0, vision=5e-4, num_steps=500, rel_err_p50=0.05, r2=0.99)
    got = {}
    for name, model in (("no encoder cost", base), ("0.5 ms an image token", slow)):
        report = FitReport(model, 500, 0.0, 0.0)
        (pred,) = predict_settings(report, images, SHAPE, [Setting(2048)], GENEROUS)
        got[name] = pred.ttft_p99_ms
    # 1,196 image tokens at 0.5 ms each: ~0.6 s more before an image request's first token
    assert got["0.5 ms an image token"] - got["no encoder cost"] == pytest.approx(598, rel=0.1)


def test_probe_stall_is_the_costliest_chunk_step() -> None:
    # 5 ms a step, 0.1 ms a prefill token, 0.5 ms a decode token: a chunk of 255 tokens beside
    # one stream's token (budget 256), of 1023 at 1024, of the cap where it is smaller
    f = fit()
    assert probe_stall_ms(f, Setting(256), 8000) == pytest.approx(5 + 25.5 + 0.5)
    assert probe_stall_ms(f, Setting(1024), 8000) == pytest.approx(5 + 102.3 + 0.5)
    assert probe_stall_ms(f, Setting(1024, 128), 8000) == pytest.approx(5 + 12.8 + 0.5)
    assert probe_stall_ms(f, Setting(16384), 500) == pytest.approx(5 + 50 + 0.5)  # one chunk
    # with attention, the last chunk (the longest context) costs most, and the pause counts
    model = CostModel(0.005, 1e-4, 5e-4, 1e-8, num_steps=500, rel_err_p50=0.05, r2=0.99)
    attn = FitReport(model, 500, 0.002, 0.003)
    last = chunk_pairs(7 * 1000, 1000) + 101
    expect = (0.005 + 0.1 + 0.0005 + last * 1e-8 + 0.002) * 1e3
    assert probe_stall_ms(attn, Setting(1001), 8000, stream_context=100) == pytest.approx(expect)
    with pytest.raises(ValueError, match="prompt_tokens"):
        probe_stall_ms(f, Setting(256), 0)


def test_in_quiet_chat_it_moves_to_a_setting_ready_for_a_long_prompt() -> None:
    # Quiet chat: every setting meets both SLOs and keeps every gap within them, so the traffic
    # cannot tell them apart. A prompt of the engine's max_model_len arriving now would stall a
    # stream 1.6 s at 16384 and 108 ms at 1024, past the 100 ms ITL SLO, 31 ms at 256: it moves
    # to 256 (confirmed over two ticks), says why, and stays there
    shape = EngineShape(num_kv_blocks=4096, max_token_budget=16384, max_model_len=16384)
    ap = pilot(start=Setting(16384))
    first = ap.decide(0.0, fit(), traffic(rag=False), shape)
    assert first.kind == "hold", first.reason
    ready = {p.setting.budget: p.readiness for p in first.predictions}
    assert ready == {256: 0, 1024: -1, 16384: -5}  # 31 ms; 108 within 2x; 1.6 s within 32x
    assert len({p.meet_key() for p in first.predictions}) == 1  # the traffic ties them
    d = ap.decide(1.0, fit(), traffic(1, rag=False), shape)
    assert d.kind == "change" and d.setting == Setting(256), d.reason
    assert "a prompt of 16383 tokens arriving now would stall streams 31 ms here" in d.reason
    assert json.loads(json.dumps(d.to_dict()))["chosen"]["readiness"] == 0
    ap.moved(d.setting, 1.0)
    for tick in range(2, 8):
        assert ap.decide(float(tick), fit(), traffic(tick, rag=False), shape).kind == "hold"
    # without the probe (--probe-tokens 0, or an engine that does not report max_model_len)
    # the tie holds where it is
    for ap, sh in ((pilot(start=Setting(16384), probe_tokens=0), shape), (pilot(), SHAPE)):
        for tick in range(3):
            d = ap.decide(float(tick), fit(), traffic(tick, rag=False), sh)
            assert d.kind == "hold" and d.setting == Setting(16384), d.reason


def test_a_probe_past_the_steps_the_fit_has_seen_is_flagged_and_the_reason_says_so() -> None:
    # a fit from quiet chat alone (its largest step: 300 prefill tokens) cannot know what a
    # 16383-token prompt costs: the figures are extrapolations, and the move says so; their
    # order holds (a larger chunk costs more whatever the costs), so the move still stands
    shape = EngineShape(num_kv_blocks=4096, max_token_budget=16384, max_model_len=16384)
    chat_only = dataclasses.replace(fit(), seen={"prefill_tokens": 300, "attention_pairs": 10**5})
    assert probe_extrapolated(chat_only, Setting(256), 16383) is False  # 255 tokens: seen
    assert probe_extrapolated(chat_only, Setting(1024), 16383) is True
    assert probe_extrapolated(fit(), Setting(1024), 16383) is None  # the fit does not say
    ap = pilot(start=Setting(16384))
    ap.decide(0.0, chat_only, traffic(rag=False), shape)
    d = ap.decide(1.0, chat_only, traffic(1, rag=False), shape)
    assert d.kind == "change" and d.setting == Setting(256), d.reason
    assert d.chosen is not None and d.left is not None
    assert (d.chosen.probe_extrapolated, d.left.probe_extrapolated) == (False, True)
    assert "past the largest step the fit has seen (300 prefill tokens)" in d.reason
    # a fit that saw long prompts: nothing to flag
    seen = dataclasses.replace(fit(), seen={"prefill_tokens": 16384, "attention_pairs": 10**9})
    ap = pilot(start=Setting(16384))
    ap.decide(0.0, seen, traffic(rag=False), shape)
    d = ap.decide(1.0, seen, traffic(1, rag=False), shape)
    assert d.kind == "change" and "past the largest step" not in d.reason, d.reason


def test_among_settings_ready_for_one_prompt_the_one_ready_for_several_wins() -> None:
    # a cap bounds each prompt's chunk, not their sum: at 16384 cap 128 one 16383-token prompt
    # would stall a stream 18 ms (ready under the 100 ms SLO), as at 256 (31 ms); several
    # arriving together fill 16384-token steps (1.6 s) against 256-token ones. In quiet chat it
    # moves from 16384 cap 128 to 256, saying why, and stays there
    shape = EngineShape(num_kv_blocks=4096, max_token_budget=16384, max_model_len=16384)
    grid = (Setting(256), Setting(16384), Setting(16384, 128))
    ap = Autopilot(AutopilotConfig(candidates=grid, start=Setting(16384, 128)), SLO)
    first = ap.decide(0.0, fit(), traffic(rag=False), shape)
    by = {p.setting: p for p in first.predictions}
    assert by[Setting(16384, 128)].readiness == by[Setting(256)].readiness == 0
    assert by[Setting(16384, 128)].burst_readiness == -5 and by[Setting(256)].burst_readiness == 0
    d = ap.decide(1.0, fit(), traffic(1, rag=False), shape)
    assert d.kind == "change" and d.setting == Setting(256), d.reason
    assert "prompts of 16383 tokens arriving together would stall streams 31 ms here" in d.reason
    ap.moved(d.setting, 1.0)
    assert all(
        ap.decide(float(t), fit(), traffic(t, rag=False), shape).kind == "hold" for t in range(2, 6)
    )


def test_the_traffic_outranks_readiness(monkeypatch: pytest.MonkeyPatch) -> None:
    # at 256 (ready) the look-back's requests are predicted to meet the SLOs less often than at
    # 16384 (not ready): it moves to 16384, by the fast path of a large gain
    script_predictions(monkeypatch, [{256: 40, 1024: 44, 16384: 50}])
    shape = EngineShape(num_kv_blocks=4096, max_token_budget=16384, max_model_len=16384)
    ap = pilot(start=Setting(256))
    d = ap.decide(0.0, fit(), traffic(), shape)
    assert d.kind == "change" and d.setting == Setting(16384), d.reason
    assert d.chosen is not None and d.chosen.readiness == -5


def test_readiness_counts_doublings_of_the_slo() -> None:
    assert [readiness(ms, 250.0) for ms in (10, 250, 251, 500, 501, 2793)] == [0, 0, -1, -1, -2, -4]


def test_with_no_setting_ready_the_least_stall_by_a_factor_of_two_wins_ties() -> None:
    # a 16383-token probe under a 20 ms ITL SLO: 256 stalls 31 ms (-1), 1024 108 ms (-3),
    # 16384 1.6 s (-7). From 16384 it moves to 256; from 1024 too; 256 stays
    shape = EngineShape(num_kv_blocks=4096, max_token_budget=16384, max_model_len=16384)
    slo = AutopilotSlo(itl_ms=20.0, ttft_ms=3000.0)
    for start in (Setting(16384), Setting(1024)):
        ap = pilot(start=start, slo=slo)
        ap.decide(0.0, fit(), traffic(rag=False), shape)
        d = ap.decide(1.0, fit(), traffic(1, rag=False), shape)
        assert d.kind == "change" and d.setting == Setting(256), d.reason
    ap = pilot(start=Setting(256), slo=slo)
    assert all(
        ap.decide(float(t), fit(), traffic(t, rag=False), shape).kind == "hold" for t in range(4)
    )
