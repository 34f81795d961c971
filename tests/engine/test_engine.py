"""LLMEngine behaviour: sampling, stops, refusals, aborts, live control, events."""

from __future__ import annotations

import random
import threading

import pytest

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from wire.events import ControlEvent, RequestEvent, StepEvent, event_from_dict


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _drain(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            return out
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("engine did not finish")


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_engine) -> None:
    params = SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = make_engine().generate([_prompt(30)], params)[0].token_ids
    engine = make_engine(token_budget=16)
    others = [_prompt(50 + i, i + 1) for i in range(4)]
    mixed = engine.generate([*others, _prompt(30)], [SamplingParams(max_tokens=5)] * 4 + [params])
    assert mixed[-1].token_ids == alone


def test_top_k_one_is_greedy(make_engine) -> None:
    engine = make_engine()
    greedy = engine.generate(
        [_prompt(20)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    top1 = engine.generate(
        [_prompt(20)], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    )
    assert greedy[0].token_ids == top1[0].token_ids


def test_stop_token_and_max_tokens(make_engine) -> None:
    engine = make_engine()
    full = engine.generate(
        [_prompt(20)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    stop_at = full.token_ids[3]
    first = full.token_ids.index(stop_at)
    stopped = engine.generate(
        [_prompt(20)], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_at,))
    )[0]
    assert stopped.token_ids == full.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_refuses_requests_that_can_never_fit(make_engine) -> None:
    engine = make_engine(max_model_len=256, num_kv_blocks=8, block_size=16)
    with pytest.raises(ValueError, match="context"):
        engine.add_request(_prompt(250), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request(_prompt(200), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 999], SamplingParams())
    with pytest.raises(ValueError, match="at least one"):
        engine.add_request([], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_bad_config_is_refused() -> None:
    for bad in (
        dict(token_budget=0),
        dict(token_budget=10, max_token_budget=5),
        dict(policy="fast"),
        dict(block_size=0),
        dict(device="tpu"),
    ):
        with pytest.raises((ValueError, TypeError)):
            EngineConfig(**bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown model"):
        from engine.llm_engine import LLMEngine

        LLMEngine(EngineConfig(model="no-such-model"))


def test_abort_frees_blocks_at_once(make_engine) -> None:
    engine = make_engine(token_budget=32)
    rid = engine.add_request(_prompt(100), SamplingParams(max_tokens=1000, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort_request(rid)
    res = engine.step()
    assert [(o.request_id, o.finish_reason) for o in res.outputs] == [(rid, "abort")]
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_budget_change_from_another_thread_applies_next_step(make_engine) -> None:
    engine = make_engine(token_budget=64, max_token_budget=512)
    for i in range(4):
        engine.add_request(_prompt(400, i), SamplingParams(max_tokens=30, ignore_eos=True))
    results: list[ControlEvent] = []
    steps: list[StepEvent] = []
    engine.add_listener(lambda e: steps.append(e) if isinstance(e, StepEvent) else None)
    for _ in range(3):
        engine.step()
    t = threading.Thread(target=lambda: results.append(engine.set_token_budget(16)))
    t.start()
    t.join()
    res = results[0]
    assert res.accepted and res.old_value == 64 and res.new_value == 16
    _drain(engine)
    by_step = {s.step: s for s in steps}
    assert by_step[res.applied_at_step - 1].token_budget == 64
    assert all(s.token_budget == 16 for s in steps if s.step >= res.applied_at_step)
    assert all(s.num_scheduled_tokens <= s.token_budget for s in steps)


def test_refused_control_keeps_old_budget(make_engine) -> None:
    engine = make_engine(token_budget=64, max_token_budget=128)
    for bad in (0, 129, "64", 1.5, None):
        ev = engine.set_token_budget(bad)
        assert not ev.accepted and ev.reason
    assert engine.token_budget == 64
    assert not engine.set_policy("eager").accepted and engine.policy == "chunked"


def test_events_round_trip_and_request_lifecycle(make_engine) -> None:
    engine = make_engine(token_budget=16)
    events = []
    engine.add_listener(events.append)
    rid = engine.add_request(
        _prompt(40), SamplingParams(max_tokens=3, ignore_eos=True), traffic_class="rag"
    )
    _drain(engine)
    kinds = [e.kind for e in events if isinstance(e, RequestEvent)]
    assert kinds == ["arrived", "first_scheduled", "first_token", "finished"]
    assert all(e.traffic_class == "rag" for e in events if isinstance(e, RequestEvent))
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [c.num_tokens for s in steps for c in s.chunks] == [16, 16, 8, 1, 1]
    assert sum(c.produced_token for s in steps for c in s.chunks) == 3
    assert {e.request_id for e in events if isinstance(e, RequestEvent)} == {rid}
    assert {c.request_id for s in steps for c in s.chunks} == {rid}
    for e in events:
        assert event_from_dict(e.to_dict()) == e


def test_listener_failure_stops_nothing(make_engine) -> None:
    engine = make_engine()

    def broken(_e: object) -> None:
        raise RuntimeError("observer down")

    engine.add_listener(broken)
    out = engine.generate([_prompt(10)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def test_preemption_under_memory_pressure_keeps_outputs(make_engine) -> None:
    prompts = [_prompt(60, i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine(token_budget=64).generate(prompts, params)
    tight_engine = make_engine(token_budget=64, num_kv_blocks=20, block_size=16)
    preempted = []
    tight_engine.add_listener(
        lambda e: (
            preempted.append(e) if isinstance(e, RequestEvent) and e.kind == "preempted" else None
        )
    )
    tight = tight_engine.generate(prompts, params)
    assert preempted, "the tight cache should force preemptions"
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]
    assert tight_engine.stats().kv_blocks_used == 0
