from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.core.cost_model import CostModel, StepWork, chunk_pairs, fit


def test_chunk_pairs_counts_context_and_causal_triangle() -> None:
    assert chunk_pairs(0, 1) == 1  # the first token attends to itself
    assert chunk_pairs(0, 4) == 1 + 2 + 3 + 4
    assert chunk_pairs(10, 1) == 11  # a decode at position 10 sees 11 keys
    assert chunk_pairs(8, 4) == 4 * 8 + 10
    # chunking a prompt never changes its total pairs
    assert chunk_pairs(0, 8) == chunk_pairs(0, 3) + chunk_pairs(3, 5)
    with pytest.raises(ValueError):
        chunk_pairs(-1, 3)


def test_step_work_from_chunk_dicts_and_objects() -> None:
    class Chunk:
        def __init__(self, kind: str, start: int, num_tokens: int) -> None:
            self.kind, self.start, self.num_tokens = kind, start, num_tokens

    dicts = [
        {"kind": "decode", "start": 99, "num_tokens": 1},
        {"kind": "prefill", "start": 0, "num_tokens": 512},
    ]
    objs = [Chunk("decode", 99, 1), Chunk("prefill", 0, 512)]
    for chunks in (dicts, objs):
        w = StepWork.from_chunks(chunks)
        assert (w.prefill_tokens, w.decode_tokens) == (512, 1)
        assert w.attention_pairs == 100 + 512 * 513 // 2
        assert w.decode_pairs == 100  # the decode chunk's share: its context and itself


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    true = CostModel(const=0.004, prefill=2.0e-5, decode=1.5e-4, attn=3.0e-9)
    works = []
    for _ in range(300):
        decodes = int(rng.integers(0, 32))
        prefill_start = int(rng.integers(0, 8000))
        prefill = int(rng.integers(0, 2048))
        pairs = decodes * int(rng.integers(100, 2000)) + chunk_pairs(prefill_start, prefill)
        works.append(StepWork(prefill, decodes, pairs))
    times = [true.predict(w) * (1 + rng.normal(0, 0.01)) for w in works]
    model = fit(works, times)
    assert model.const == pytest.approx(true.const, rel=0.1)
    assert model.prefill == pytest.approx(true.prefill, rel=0.05)
    assert model.decode == pytest.approx(true.decode, rel=0.1)
    assert model.attn == pytest.approx(true.attn, rel=0.05)
    assert model.rel_err_p50 < 0.02 and model.r2 > 0.99
    assert model.num_steps == 300
    again = CostModel.from_dict({**model.to_dict(), "unknown_field": 1})
    assert again == model


def test_fit_keeps_coefficients_non_negative() -> None:
    # decode tokens never vary with time here: their coefficient must not go negative
    works = [StepWork(p, 0, p * p // 2) for p in range(64, 4096, 64)]
    times = [0.002 + 1e-5 * w.prefill_tokens for w in works]
    model = fit(works, times)
    assert min(model.const, model.prefill, model.decode, model.attn) >= 0.0
    assert model.predict(StepWork(1000, 0, 500_000)) == pytest.approx(0.012, rel=0.05)


def test_fit_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="at least"):
        fit([StepWork(1, 1, 1)], [0.1])
    with pytest.raises(ValueError, match="steps but"):
        fit([StepWork(1, 1, 1)] * 5, [0.1] * 4)
    with pytest.raises(ValueError, match="finite"):
        fit([StepWork(i, 1, i) for i in range(5)], [0.1, 0.2, float("nan"), 0.1, 0.1])


def test_cost_model_imports_no_torch() -> None:
    code = "import sys, engine.core.cost_model; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_weighted_fit_solves_for_relative_error() -> None:
    # short steps follow one law, one long outlier step another: the relative fit follows the
    # many short steps, the plain one is pulled towards the outlier
    works = [StepWork(0, d, d * 100) for d in range(1, 40)] + [StepWork(4000, 0, 8_000_000)]
    times = [0.001 + 1e-4 * w.decode_tokens for w in works[:-1]] + [5.0]
    plain = fit(works, times)
    relative = fit(works, times, weights=[1 / t for t in times])
    short = StepWork(0, 20, 2000)
    assert relative.predict(short) == pytest.approx(0.003, rel=0.05)
    assert abs(plain.predict(short) - 0.003) >= abs(relative.predict(short) - 0.003)
    with pytest.raises(ValueError, match="weights"):
        fit(works, times, weights=[0.0] * len(works))


def test_a_decode_pair_costs_its_own_term() -> None:
    """Issue 19: a decode token reads its context slot by slot, so its pairs cost more than a
    prefill chunk's; the fit recovers both, and a model without the term predicts as before."""
    rng = np.random.default_rng(1)
    true = CostModel(const=0.005, prefill=3e-4, decode=8e-4, attn=4e-8, attn_decode=1.5e-6)
    works = []
    for _ in range(400):
        dec = int(rng.integers(0, 16))
        dpairs = dec * int(rng.integers(50, 4000))
        n, start = int(rng.integers(0, 1024)), int(rng.integers(0, 3000))
        works.append(StepWork(n, dec, chunk_pairs(start, n) + dpairs, dpairs))
    times = [true.predict(w) * (1 + rng.normal(0, 0.01)) for w in works]
    model = fit(works, times)
    assert model.attn_decode == pytest.approx(true.attn_decode, rel=0.05)
    assert model.attn == pytest.approx(true.attn, rel=0.1)
    assert model.predict_many(works) == pytest.approx([model.predict(w) for w in works])
    old = CostModel.from_dict({"const": 0.005, "prefill": 3e-4, "decode": 8e-4, "attn": 4e-8})
    assert old.attn_decode == 0.0
    assert old.predict(StepWork(0, 4, 4000, 4000)) == pytest.approx(0.005 + 4 * 8e-4 + 4000 * 4e-8)
