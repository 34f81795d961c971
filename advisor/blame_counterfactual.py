"""The ledger's blame beside the simulator's counterfactual: a window's traffic replayed through
the engine's own scheduler (``advisor.simulate``) with and without a culprit, step times from
the fitted model; the others' predicted gain next to what the ledger blamed on it. No torch."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from advisor.blame import BlameError, Ledger
from advisor.simulate import SimResult, cost_model_step_ns, simulate
from advisor.traffic import engine_shape, observed_traffic, to_sim_requests


@dataclass(frozen=True)
class Counterfactual:
    culprits: tuple[str, ...]
    victims: int  # requests of the window other than the culprits, finished in both replays
    predicted_gain_ms: float  # their arrival-to-last-token time, with the culprits minus without
    blamed_ms: float  # what the ledger blamed on the culprits in those requests' gaps
    gain_by_victim: dict[str, float] = field(default_factory=dict)
    blamed_by_victim: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "culprits": list(self.culprits),
            "victims": self.victims,
            "predicted_gain_ms": self.predicted_gain_ms,
            "blamed_ms": self.blamed_ms,
        }


def _life_ms(result: SimResult) -> dict[str, float]:
    return {
        o.request_id: (o.token_times_ns[-1] - o.arrival_ns) / 1e6
        for o in result.requests
        if o.token_times_ns
    }


def counterfactual(
    db: Engine,
    ledger: Ledger,
    culprits: Collection[str],
    *,
    gap_s: float = 0.0,
) -> Counterfactual:
    """Replay the ledger's window (the requests that arrived in it) at the budget and cap of its
    first step, with and without ``culprits``; ``gap_s``: the pause between steps (the fit's
    ``step_gap_s``)."""
    w = ledger.window
    wanted = set(culprits)
    if not wanted:
        raise BlameError("name at least one culprit")
    steps = w.steps.sort_values("step")
    since, until = float(steps["start"].min()), float(steps["end"].max())
    traffic = observed_traffic(db, engine_id=w.engine_id, run_id=w.run_id, since=since, until=until)
    shape = engine_shape(db, engine_id=w.engine_id, run_id=w.run_id)
    reqs, warm = to_sim_requests(traffic, shape.block_size)
    missing = wanted - {r.request_id for r in reqs}
    if missing:
        raise BlameError(f"not among the window's requests: {', '.join(sorted(missing))}")
    first = ledger.steps.iloc[0]
    budget = int(first["token_budget"])
    raw_cap = first.get("long_prefill_token_threshold")
    cap = 0 if raw_cap is None or raw_cap != raw_cap else int(raw_cap)
    step_ns = cost_model_step_ns(ledger.model.predict)
    gap_ns = round(gap_s * 1e9)

    def replay(requests: list[Any]) -> dict[str, float]:
        res = simulate(
            requests,
            shape,
            token_budget=budget,
            step_ns=step_ns,
            gap_ns=gap_ns,
            warm_prefixes=warm,
            long_prefill_token_threshold=cap,
        )
        return _life_ms(res)

    with_ = replay(reqs)
    without = replay([r for r in reqs if r.request_id not in wanted])
    victims = sorted(set(with_) & set(without))
    gain = {v: with_[v] - without[v] for v in victims}
    blamed: dict[str, float] = {}
    for v in victims:
        if v in ledger.index:
            out = ledger.request(v)
            blamed[v] = sum(c["ms"] for c in out["culprits"] if c["request_id"] in wanted)
    return Counterfactual(
        tuple(sorted(wanted)),
        len(victims),
        sum(gain.values()),
        sum(blamed.values()),
        gain,
        blamed,
    )
