"""The offline ``SamplingParams`` constructor refuses what the sampler cannot run."""

from __future__ import annotations

import pytest

from engine.core.sampling_params import (
    MAX_SEED,
    MAX_STOP_TOKEN_IDS,
    MIN_SEED,
    MIN_TEMPERATURE,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": 5e-324}, "temperature"),
        ({"temperature": MIN_TEMPERATURE / 2}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"seed": MIN_SEED - 1}, "seed"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"stop_token_ids": (1, -1)}, "stop_token_ids"),
        ({"stop_token_ids": (2**63,)}, "stop_token_ids"),
    ],
)
def test_refuses_what_the_sampler_cannot_run(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": MIN_TEMPERATURE},
        {"temperature": 100.0},
        {"seed": 0},
        {"seed": MAX_SEED},
        {"seed": MIN_SEED},
        {"top_k": 50},
        {"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS))},
        {"stop_token_ids": [7, 8]},
    ],
)
def test_accepts_the_edges(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    assert isinstance(params.stop_token_ids, tuple)
