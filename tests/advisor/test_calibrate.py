"""The calibration (issue 19a): long prefill chunks of every budget's size, run on the engine and
fitted with the traffic window's steps; and the noise model's bins by duration."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from advisor.calibrate import Calibration, CalibrationError, calibrate
from advisor.fit import calibration_fit, duration_bins, noise_model, robust_fit
from engine.core.cost_model import CostModel, StepWork, chunk_pairs

MODEL = CostModel(const=0.007, prefill=3e-4, decode=5e-4, attn=6e-8, attn_decode=1.5e-6)


class _Engine(BaseHTTPRequestHandler):
    """Stands in for the engine's control and completion routes; records what it was sent."""

    calls: list[tuple[str, str, Any, str | None]] = []
    budget = 1024
    refuse_prompt = False

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"null")

    def do_GET(self) -> None:  # noqa: N802
        type(self).calls.append(("GET", self.path, None, None))
        if self.path == "/v1/scheduler":
            self._answer(200, {"token_budget": type(self).budget, "max_token_budget": 4096})
        else:
            self._answer(200, {"data": [{"id": "demo"}]})

    def do_PUT(self) -> None:  # noqa: N802
        body = self._body()
        type(self).calls.append(("PUT", self.path, body, self.headers.get("Authorization")))
        type(self).budget = int(body["token_budget"])
        self._answer(200, {"token_budget": type(self).budget})

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        type(self).calls.append(("POST", self.path, body, self.headers.get("X-Traffic-Class")))
        if type(self).refuse_prompt:
            self._answer(400, {"error": {"message": "token id outside the vocabulary"}})
        else:
            self._answer(200, {"choices": [{"text": "x"}]})


@pytest.fixture
def engine() -> Iterator[str]:
    _Engine.calls, _Engine.budget, _Engine.refuse_prompt = [], 1024, False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_calibration_runs_every_prompt_at_every_budget_and_restores_the_budget(
    engine: str,
) -> None:
    cal = calibrate(
        engine,
        [512, 128, 8192],  # 8192 is above the engine's max_token_budget: skipped
        prompt_tokens=(100, 300),
        repeats=2,
        control_token="tok",
        max_model_len=200,
        decode_batches=(2, 3),
    )
    assert isinstance(cal, Calibration) and cal.budgets == [128, 512] and cal.requests == 13
    assert cal.until >= cal.since and cal.decode_batches == [2, 3]
    puts = [c for c in _Engine.calls if c[0] == "PUT"]
    # the old budget restored before the decode batches, and again at the end
    assert [p[2]["token_budget"] for p in puts] == [128, 512, 1024, 1024]
    assert all(p[3] == "Bearer tok" for p in puts)
    posts = [c for c in _Engine.calls if c[0] == "POST"]
    decodes, posts = posts[8:], posts[:8]
    assert len(decodes) == 5 and all(p[2]["max_tokens"] == 32 for p in decodes)
    assert len({tuple(p[2]["prompt"]) for p in decodes}) == 5
    # prompts cut to the context less two; fresh random prompts each time; one output token
    assert [len(p[2]["prompt"]) for p in posts] == [100, 198] * 4
    assert len({tuple(p[2]["prompt"]) for p in posts}) == 8
    assert all(p[2]["max_tokens"] == 1 and p[2]["model"] == "demo" for p in posts)
    assert all(p[3] == "calibration" for p in posts)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))) == cal


def test_a_refused_prompt_is_an_error_and_the_budget_is_still_restored(engine: str) -> None:
    _Engine.refuse_prompt = True
    with pytest.raises(CalibrationError, match="vocabulary"):
        calibrate(engine, [256], prompt_tokens=(50,), repeats=1, decode_batches=())
    assert _Engine.budget == 1024


def _steps(
    rng: np.random.Generator, budgets: list[int], prompts: list[int]
) -> tuple[list[StepWork], np.ndarray]:
    works = []
    for b in budgets:
        for p in prompts:
            s = 0
            while s < p:
                n = min(b, p - s)
                works.append(StepWork(n, 0, chunk_pairs(s, n)))
                s += n
    return works, MODEL.predict_many(works) * rng.normal(1.0, 0.02, len(works))


def _window(rng: np.random.Generator, speed: float) -> tuple[list[StepWork], np.ndarray]:
    """A window at budget 1024: 400 decode steps, 6 prefill chunks of 1024 (few, scattered)."""
    works = []
    for _ in range(400):
        d = int(rng.integers(1, 9))
        ctx = int(rng.integers(100, 3000))
        works.append(StepWork(0, d, d * ctx, d * ctx))
    for i in range(6):
        works.append(StepWork(1024, 2, chunk_pairs(1024 * (i % 3), 1024) + 400, 400))
    t = MODEL.predict_many(works) * speed * rng.normal(1.0, 0.03, len(works))
    t[-6:] *= np.array([1.0, 1.5, 0.9, 1.4, 1.0, 1.3])  # a few long steps, slowed by others
    return works, t


def test_the_level_is_matched_on_chunks_not_on_short_prompts_beside_decodes() -> None:
    """A window's short prefill steps (chat prompts of 40-100 tokens beside decodes) run 1.25x
    the model whatever the machine's speed; its 1,024-token chunks at the calibration's own
    speed. The level comes from the chunks (about 1.0), not from the short steps' majority
    (1.25: every other budget's chunks would then be predicted a quarter too long)."""
    rng = np.random.default_rng(5)
    works, t = [], []
    for _ in range(300):
        d = int(rng.integers(1, 6))
        w = StepWork(0, d, d * 500, d * 500)
        works.append(w)
        t.append(MODEL.predict(w))
    for _ in range(30):
        n, d = int(rng.integers(40, 100)), int(rng.integers(1, 6))
        w = StepWork(n, d, chunk_pairs(0, n) + d * 500, d * 500)
        works.append(w)
        t.append(MODEL.predict(w) * 1.25)
    for i in range(8):
        w = StepWork(1024, 2, chunk_pairs(1024 * (i % 3), 1024) + 1000, 1000)
        works.append(w)
        t.append(MODEL.predict(w))
    meas = np.array(t) * rng.normal(1.0, 0.02, len(t))
    cal_works, cal_t = _steps(rng, [128, 512, 4096], [600, 1900, 3900])
    _, _, info, _, _ = calibration_fit(works, meas, cal_works, cal_t)
    assert info["level_min_prefill_tokens"] == 128 and info["num_window_prefill_steps"] == 8
    assert 0.93 < info["level"] < 1.07
    # with fewer than LEVEL_MIN_STEPS chunks in the window, every prefill step sets it
    few = works[:-6], meas[:-6]
    _, _, info_few, _, _ = calibration_fit(*few, cal_works, cal_t)
    assert info_few["level_min_prefill_tokens"] == 1 and info_few["num_window_prefill_steps"] == 32


def test_calibration_pins_the_prefill_cost_the_window_cannot() -> None:
    rng = np.random.default_rng(3)
    works, t = _window(rng, 1.1)  # the window ran 10% slower than the idle engine
    cal_works, cal_t = _steps(rng, [128, 512, 1024, 4096], [600, 1900, 3900])
    model, inliers, info, fit_works, y = calibration_fit(works, t, cal_works, cal_t)
    alone, _ = robust_fit(works, t)
    assert len(inliers) == len(fit_works) == len(works) + len(cal_works) == len(y)
    # the calibration's level is matched to the window's (about 1.1x, its prefill steps' median)
    assert 1.0 < info["level"] < 1.3 and info["num_steps"] == len(cal_works)
    # 128-token chunks at long context: the calibrated fit within 12% of the window's speed,
    # the window alone (6 noisy 1024-token chunks) further off
    probe = [StepWork(128, 0, chunk_pairs(s, 128)) for s in range(0, 3900, 128)]
    truth = float(np.sum(MODEL.predict_many(probe))) * 1.1
    err_cal = abs(float(np.sum(model.predict_many(probe))) - truth) / truth
    err_alone = abs(float(np.sum(alone.predict_many(probe))) - truth) / truth
    assert err_cal < 0.12 and err_cal < err_alone


def test_duration_bins_keep_long_steps_apart() -> None:
    pred = np.sort(np.concatenate([np.linspace(5e-3, 12e-3, 300), np.linspace(0.2, 0.6, 30)]))
    bins = duration_bins(pred, 1.6, 20)
    assert sum(len(b) for b in bins) == len(pred)
    top = pred[bins[-1]]
    assert top.min() >= 0.2  # the long steps are not binned with the 5-12 ms ones
    assert all(len(b) >= 20 for b in bins)
    # every bin spans at most the factor, except where it had to fill up to 20 steps
    for b in bins:
        assert pred[b[-1]] <= 1.6 * pred[b[0]] * 1.01 or len(b) <= 40
    # a short tail joins the bin before it
    assert len(duration_bins(np.array([1.0] * 25 + [100.0] * 3), 1.6, 20)) == 1


def test_noise_by_duration_gives_long_steps_their_own_scatter() -> None:
    short = np.linspace(5e-3, 12e-3, 400)
    long = np.linspace(0.2, 0.5, 40)
    pred = np.concatenate([short, long])
    ratio = np.concatenate([np.where(np.arange(400) % 4 == 0, 2.0, 1.0), np.full(40, 1.05)])
    by_count = noise_model(pred, pred * ratio, np.empty(0))
    by_duration = noise_model(pred, pred * ratio, np.empty(0), binning="duration")
    assert max(by_count.ratios[-1]) == pytest.approx(2.0)  # the top bin mixes 10 ms and 0.3 s
    assert set(np.round(by_duration.ratios[-1], 6)) == {1.05}
    with pytest.raises(ValueError, match="binning"):
        noise_model(pred, pred, np.empty(0), binning="other")


def test_cli_calibrate_writes_the_record_predict_reads(engine: str, tmp_path: Any) -> None:
    from advisor.cli import _span, main

    out = tmp_path / "cal.json"
    args = ["calibrate", "--url", engine, "--budgets", "128,256", "--prompt-tokens", "40,80"]
    assert main([*args, "--repeats", "1", "--decode-batches", "2", "--out", str(out)]) == 0
    since, until = _span(str(out))
    assert until >= since
    assert json.loads(out.read_text())["requests"] == 6
    _Engine.refuse_prompt = True
    assert main([*args, "--out", str(tmp_path / "bad.json")]) == 1


def test_the_vision_encoder_has_its_own_term() -> None:
    import pandas as pd

    from advisor.fit import step_works
    from engine.core.cost_model import fit

    # a chunk of 512 tokens of a request whose prompt is 80% image tokens: 410 image tokens
    chunks = [
        {"request_id": "img", "kind": "prefill", "start": 0, "num_tokens": 512},
        {"request_id": "chat", "kind": "decode", "start": 99, "num_tokens": 1},
    ]
    work = StepWork.from_chunks(chunks, {"img": 0.8})
    assert work.image_tokens == 410 and work.prefill_tokens == 512
    assert StepWork.from_chunks(chunks).image_tokens == 0
    # the store side counts them the same way
    df = pd.DataFrame([{**c, "engine_id": "e", "run_id": "r", "step": 1} for c in chunks])
    row = step_works(df, frozenset({"img"}), {"img": 0.8}).iloc[0]
    assert int(row["image_tokens"]) == 410 and int(row["image_prefill_tokens"]) == 512
    # fitted: image tokens cost 2x a text prefill token more, and the fit finds it
    truth = CostModel(const=0.005, prefill=3e-4, decode=5e-4, attn=6e-8, vision=6e-4)
    rng = np.random.default_rng(0)
    works = [
        StepWork(int(n), int(d), chunk_pairs(0, int(n)), 0, int(n * s))
        for n, d, s in zip(
            rng.integers(1, 1024, 300),
            rng.integers(0, 8, 300),
            rng.choice([0, 0, 0.9], 300),
            strict=True,
        )
    ]
    model = fit(works, list(truth.predict_many(works)))
    assert model.vision == pytest.approx(6e-4, rel=1e-3)
    assert CostModel.from_dict({"const": 1, "prefill": 0, "decode": 0, "attn": 0}).vision == 0


def test_a_burst_of_image_requests_enters_as_the_engine_takes_it_in() -> None:
    from advisor.simulate import EngineShape, SimRequest, simulate

    reqs = [
        SimRequest(f"img-{i}", 1_000, tuple(range(i * 10_000, i * 10_000 + 300)), 2, "vlm")
        for i in range(3)
    ] + [SimRequest("chat", 1_000, tuple(range(90_000, 90_040)), 2, "chat")]
    images = {"img-0", "img-1", "img-2"}

    def first_steps(shape: EngineShape, **kw: Any) -> list[set[str]]:
        res = simulate(
            reqs, shape, token_budget=4096, step_ns=lambda plan: 1_000_000, record_steps=True, **kw
        )
        return [{c.request_id for c in s.chunks if c.kind == "prefill"} for s in res.steps[:3]]

    # the engine core reads its commands ahead: everything that arrived shares the first step
    now = EngineShape(num_kv_blocks=1024)
    assert first_steps(now, image_requests=images)[0] == {"img-0", "img-1", "img-2", "chat"}
    # an engine that takes one image request in per step: what arrived after one waits with it
    one = EngineShape(num_kv_blocks=1024, image_requests_per_step=1)
    assert first_steps(one)[0] == {"img-0", "img-1", "img-2", "chat"}  # no image ids given
    got = first_steps(one, image_requests=images)
    assert got == [{"img-0"}, {"img-1"}, {"img-2", "chat"}]
    # a vLLM engine's scheduler is never limited so
    vllm = EngineShape(num_kv_blocks=1024, scheduler="vllm", image_requests_per_step=1)
    res = simulate(
        reqs, vllm, token_budget=4096, step_ns=lambda plan: 1_000_000, record_steps=True,
        image_requests=images,
    )  # fmt: skip
    assert len({c.request_id for c in res.steps[0].chunks}) == 4


def test_a_lone_decode_has_no_multi_row_cost() -> None:
    m = CostModel(const=0.006, prefill=0.0, decode=0.001, attn=0.0, multi_row=0.004)
    assert m.predict(StepWork(0, 1, 100, 100)) == pytest.approx(0.007)
    assert m.predict(StepWork(0, 2, 200, 200)) == pytest.approx(0.012)
    assert m.predict(StepWork(5, 0, 15)) == pytest.approx(0.010)
    works = [StepWork(0, d, 0, 0) for d in (1, 1, 1, 2, 3, 4, 5, 6, 8, 1, 2)]
    from engine.core.cost_model import fit

    got = fit(works, list(m.predict_many(works)))
    assert got.multi_row == pytest.approx(0.004, rel=1e-6)
    assert got.const == pytest.approx(0.006, rel=1e-6)


def test_a_calibration_far_from_the_window_makes_the_fit_poor() -> None:
    from advisor.fit import _with_calibration

    assert _with_calibration({"poor": False, "reasons": []}, {}) == {"poor": False, "reasons": []}
    ok = _with_calibration({"poor": False, "reasons": []}, {"level_raw": 1.1})
    assert not ok["poor"] and ok["calibration"]["level_raw"] == 1.1
    bad = _with_calibration({"poor": False, "reasons": []}, {"level_raw": 1.45})
    assert bad["poor"] and "1.45x" in bad["reasons"][0]
