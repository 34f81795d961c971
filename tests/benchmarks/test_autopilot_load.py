"""benchmarks/autopilot_load.py: the rule that picks the autopilot benchmark's load, the
replay as simulator traffic, and one simulated arm counted per phase (no engine, no store)."""

from __future__ import annotations

from advisor.autopilot import AutopilotSlo
from advisor.fit import FitReport
from advisor.simulate import EngineShape
from benchmarks.autopilot import PHASES, Arm
from benchmarks.autopilot_load import choose, simulate_arm, to_traffic
from engine.core.cost_model import CostModel
from loadgen.spec import ImageRef, RequestSpec
from loadgen.tokens import Segment

BOUNDS = [("quiet", 0.0, 10.0), ("rag", 10.0, 20.0), ("image", 20.0, 30.0), ("quiet2", 30.0, 40.0)]


def _row(scale: float, *serves: bool) -> dict:
    return {"scale": scale, "seeds": [{"best_serves": s} for s in serves]}


def test_choose_takes_the_largest_scale_every_seed_serves() -> None:
    rows = [_row(1, True, True), _row(2, True, True), _row(3, True, False), _row(4, True, True)]
    # 4 passes on its own: the rule is the largest passing scale, not the first failure
    assert choose(rows, 0.9) == 4
    assert choose([_row(1, False, True)], 0.9) is None


def _specs() -> list[RequestSpec]:
    return [
        RequestSpec(0, "chat", 1.0, 20, (Segment("c0", 64),)),
        RequestSpec(1, "rag", 12.0, 8, (Segment("r0", 3000),)),
        RequestSpec(2, "chat", 11.95, 20, (Segment("c1", 64),)),
        RequestSpec(3, "vlm", 21.0, 10, images=(ImageRef(1280, 720, "jpeg", 1),), text="a b c"),
        RequestSpec(4, "chat", 35.0, 20, (Segment("c2", 64),)),
    ]


def test_replay_as_traffic() -> None:
    t = to_traffic(_specs(), per_image=1196, text=20, span=40.0)
    by = {r.request_id: r for r in t.requests}
    assert by["1"].num_prompt_tokens == 3000 and by["1"].num_image_tokens == 0
    assert by["3"].num_prompt_tokens == 1216 and by["3"].num_image_tokens == 1196
    assert [r.arrival for r in t.requests] == sorted(r.arrival for r in t.requests)


def test_one_arm_counted_per_phase() -> None:
    model = CostModel(0.005, 1e-4, 5e-4, 0.0, num_steps=500, rel_err_p50=0.05, r2=0.99)
    fit = FitReport(model, 500, 0.0, 0.0)
    shape = EngineShape(num_kv_blocks=4096, block_size=16, max_token_budget=16384)
    traffic = to_traffic(_specs(), per_image=1196, text=20, span=40.0)
    slo = AutopilotSlo(100.0, 2000.0)
    small = simulate_arm(fit, traffic, shape, Arm("256/0", 256, 0), slo, BOUNDS, 0)
    assert list(small) == list(PHASES)
    assert [small[p][1] for p in PHASES] == [1, 2, 1, 1]
    assert small == {p: (n, n) for p, (_, n) in small.items()}  # 256: every request meets
    # at 16384 the 3000-token prompt is one ~0.3 s step, and the chat stream that started
    # just before it waits that long between two of its 19 gaps: its p99 misses
    big = simulate_arm(fit, traffic, shape, Arm("16384/0", 16384, 0), slo, BOUNDS, 0)
    assert big["rag"][0] < small["rag"][0]
