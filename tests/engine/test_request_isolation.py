"""One request's failure in sampling or in its stop check fails that request alone: the step
goes on and every request beside it finishes as if the failing one had not been there.

The failing requests here get past validation on purpose (their params are altered after they
were built), so these tests exercise the engine's own isolation, not the edge's bounds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.process.errors import APIError
from engine.server.protocol import CompletionRequest

PROMPT = [256, 72, 101, 108, 108, 111]
NORMAL = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    yield LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=256, token_budget=256))


@pytest.fixture(scope="module")
def expected(engine: LLMEngine) -> list[int]:
    return engine.generate([PROMPT], NORMAL)[0].token_ids


def _forced(params: SamplingParams, **fields: object) -> SamplingParams:
    """``params`` with fields set past validation (what a bug or a new field could let in)."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


class _Exploding(tuple):
    def __contains__(self, item: object) -> bool:
        raise RuntimeError("stop check exploded")


def _run_beside(engine: LLMEngine, params: SamplingParams) -> tuple[dict, dict]:
    """Run a normal request and one with ``params`` from the same first step; return each
    one's (tokens, finish_reason, error, steps)."""
    other = engine.add_request(PROMPT[::-1], params)  # first: if it is refused, nothing runs
    normal = engine.add_request(PROMPT, NORMAL)
    seen: dict[str, dict] = {
        rid: {"tokens": [], "reason": None, "error": None, "steps": []} for rid in (normal, other)
    }
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        result = engine.step()
        for out in result.outputs:
            rec = seen[out.request_id]
            rec["tokens"].extend(out.new_token_ids)
            rec["steps"].append(result.event.step if result.event is not None else None)
            if out.finished:
                rec["reason"], rec["error"] = out.finish_reason, out.error
    assert not engine.has_unfinished_requests()
    assert seen[normal]["steps"][0] == seen[other]["steps"][0]  # one step held both
    return seen[normal], seen[other]


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-40},
        {"temperature": 5e-324},
        {"temperature": float("nan")},
        {"seed": 2**64},
        {"top_p": -1.0},
        {"stop_token_ids": _Exploding((1,))},
    ],
    ids=["temperature-1e-40", "temperature-denormal", "temperature-nan", "seed-2**64",
         "top_p-negative", "stop-check-raises"],
)  # fmt: skip
def test_a_failing_request_fails_alone(
    engine: LLMEngine, expected: list[int], fields: dict
) -> None:
    bad = _forced(SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True), **fields)
    normal, other = _run_beside(engine, bad)
    assert normal["tokens"] == expected and normal["reason"] == "length"
    assert normal["error"] is None
    assert other["reason"] == "error" and other["error"], other
    assert engine.stats().num_running == 0 and engine.stats().kv_blocks_used == 0
    # the engine goes on as before
    assert engine.generate([PROMPT], NORMAL)[0].token_ids == expected


# --- any request the API accepts leaves the request beside it alone -------------------------

_floats = st.one_of(
    st.sampled_from([0.0, 1e-40, 5e-324, 1e-5, 0.009, 0.01, 0.5, 1.0, 2.0]),
    st.floats(min_value=0.0, max_value=2.0),
    st.floats(min_value=0.0, max_value=0.05),
    st.floats(allow_nan=False, allow_infinity=False),
)
_ints = st.one_of(
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.integers(),
)
_body = st.fixed_dictionaries(
    {"prompt": st.just("x"), "max_tokens": st.integers(1, 4), "ignore_eos": st.booleans()},
    optional={
        "temperature": _floats,
        "top_p": _floats,
        "top_k": _ints,
        "seed": _ints,
        "stop_token_ids": st.lists(st.one_of(st.integers(0, 600), _ints), max_size=80),
    },
)


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_body)
@example(body={"prompt": "x", "max_tokens": 2, "ignore_eos": True, "temperature": 1e-40})
@example(body={"prompt": "x", "max_tokens": 2, "ignore_eos": True, "seed": 2**64})
@example(body={"prompt": "x", "max_tokens": 2, "ignore_eos": True, "seed": -(2**63) - 1})
@example(body={"prompt": "x", "max_tokens": 2, "ignore_eos": True, "stop_token_ids": [10**6]})
def test_accepted_params_never_fail_the_request_beside(
    engine: LLMEngine, expected: list[int], body: dict
) -> None:
    import json

    from engine.server.protocol import parse_request

    try:
        req = parse_request(CompletionRequest, json.dumps(body).encode())
        params = SamplingParams(**req.sampling_kwargs(int(body["max_tokens"])))
    except (APIError, ValueError, TypeError):
        return  # refused at the edge: a 400 for this client, nothing reaches the engine
    try:
        normal, other = _run_beside(engine, params)
    except (ValueError, TypeError):
        return  # refused by the engine's own admission (a stop id outside the vocabulary)
    assert normal["tokens"] == expected and normal["reason"] == "length"
    assert normal["error"] is None
    assert other["error"] is None, other
