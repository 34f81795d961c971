"""Replay traffic through the engine's own scheduler at a token budget, with modelled step times.

No model and no torch: the engine's ``Scheduler`` and ``BlockManager`` plan every step exactly as
they do in the engine, requests are the engine's ``Request`` objects, and a discrete-event loop
stands in for the model and the clock. Each iteration is one engine step, in the engine's order
(``engine/llm_engine.py``): requests that arrived by now enter the scheduler, a budget change due
by now is applied, ``schedule()`` plans the step, the step lasts what the cost model predicts for
its chunks, ``update(plan, sampled, end_ns)`` stamps the tokens it produced at its end, and the
next step starts after the engine's pause between steps. A request stops at its observed output
length (``max_tokens`` with ``ignore_eos``). When nothing is schedulable the clock jumps to the
next arrival.

:func:`figures` turns a run into the numbers the sweep measures: chat ITL p50/p99/max (every
request's gaps between consecutive tokens, pooled; all classes when there is no chat), TTFT
p50/p99 overall and by class, and output tokens per second over the arrival span.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from advisor.overload import WindowLoad, judge
from advisor.vllm_policy import SCHEDULERS, VllmV1Scheduler
from engine.core.block_manager import BlockManager
from engine.core.cost_model import StepWork
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, StepPlan

logger = logging.getLogger(__name__)

ITL_CLASS = "chat"  # the class whose inter-token latency the SLO is about
_SAMPLED_TOKEN = 7  # the token every simulated step "samples" (only its count matters)


UNKNOWN_MODEL_LEN = 1 << 30  # an engine's max_model_len where its config does not say


@dataclass(frozen=True)
class EngineShape:
    """What the scheduler's decisions depend on besides the budget."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int = UNKNOWN_MODEL_LEN
    max_token_budget: int = 8192
    policy: str = "chunked"
    enable_prefix_caching: bool = True
    # whose step planning to replay: "chunkscope" (engine.core.scheduler) or "vllm"
    # (advisor.vllm_policy: vLLM v1's order, for an engine whose hello says engine_kind "vllm")
    scheduler: str = "chunkscope"
    # requests with images an engine takes in per step (0: every request that has arrived).
    # chunkscope's engine core reads its commands on a thread of their own and takes in all
    # that have arrived before each step (engine/process/channels.read_ahead), so 0. Before
    # that it read them off the pipe between steps, and a burst of image requests (megabytes
    # each) entered one or two a step depending on a race with the sender (issue 19a: five in
    # five successive steps; issue 19, budget 4096: two and two after a 1 s step); 1 models
    # such an engine
    image_requests_per_step: int = 0


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival_ns: int  # on the simulation's clock
    prompt_token_ids: tuple[int, ...]
    num_output_tokens: int
    traffic_class: str | None = None


@dataclass(frozen=True)
class SimChunk:
    request_id: str
    kind: str
    start: int
    num_tokens: int
    produced_token: bool
    capped: bool = False


@dataclass(frozen=True)
class SimStep:
    step: int
    token_budget: int
    start_ns: int
    end_ns: int
    chunks: tuple[SimChunk, ...]
    num_preemptions: int
    long_prefill_token_threshold: int = 0


@dataclass
class SimOutcome:
    request_id: str
    traffic_class: str | None
    arrival_ns: int
    num_prompt_tokens: int
    first_scheduled_ns: int | None = None
    token_times_ns: list[int] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass
class SimResult:
    token_budget: int
    requests: list[SimOutcome]
    steps: list[SimStep]  # empty unless asked for
    num_steps: int
    start_ns: int
    end_ns: int
    unfinished: int  # requests left when the run was cut (max_steps) or could never run
    long_prefill_token_threshold: int = 0  # the cap at the start


StepTime = Callable[[StepPlan], int]
GapTime = Callable[[], int]


def cost_model_step_ns(
    predict_s: Callable[[StepWork], float], image_share: Mapping[str, float] | None = None
) -> StepTime:
    """A step-time function from a cost model's ``predict`` (seconds of a ``StepWork``);
    ``image_share``: per request id, the share of its prompt that is image tokens (the vision
    encoder's work, ``StepWork.image_tokens``)."""

    def step_ns(plan: StepPlan) -> int:
        return max(0, round(predict_s(StepWork.from_chunks(plan.chunks, image_share)) * 1e9))

    return step_ns


def noisy_step_ns(
    predict_s: Callable[[StepWork], float],
    edges_s: Sequence[float],
    ratios: Sequence[Sequence[float]],
    rng: random.Random,
    image_share: Mapping[str, float] | None = None,
) -> StepTime:
    """The prediction times a measured/predicted ratio drawn from the steps of similar
    predicted duration (``advisor.fit.NoiseModel``): measured scatter, replayed
    (``image_share`` as :func:`cost_model_step_ns`)."""

    def step_ns(plan: StepPlan) -> int:
        pred = max(0.0, predict_s(StepWork.from_chunks(plan.chunks, image_share)))
        k = min(bisect.bisect_left(edges_s, pred), len(ratios) - 1)
        return max(0, round(pred * rng.choice(ratios[k]) * 1e9))

    return step_ns


def drawn_gap_ns(gaps_s: Sequence[float], rng: random.Random) -> GapTime:
    """A pause between steps drawn from the measured ones."""
    return lambda: max(0, round(rng.choice(gaps_s) * 1e9))


def simulate(
    requests: Sequence[SimRequest],
    shape: EngineShape,
    *,
    token_budget: int,
    step_ns: StepTime,
    gap_ns: int | GapTime = 0,
    budget_changes: Iterable[tuple[int, int]] = (),
    warm_prefixes: Iterable[Sequence[int]] = (),
    record_steps: bool = False,
    max_steps: int | None = None,
    long_prefill_token_threshold: int = 0,
    cap_changes: Iterable[tuple[int, int]] = (),
    image_requests: Collection[str] = (),
) -> SimResult:
    """Run ``requests`` through a fresh scheduler at ``token_budget`` and long-prefill cap
    ``long_prefill_token_threshold`` (0: off).

    ``budget_changes`` and ``cap_changes`` are ``(time_ns, value)``: applied before the first
    step starting at or after ``time_ns`` (as a live change is). ``gap_ns`` is the pause after
    each step (a constant or a function drawing one). ``warm_prefixes`` are token sequences
    whose full blocks are in the prefix cache at the start. ``max_steps`` cuts a runaway simulation.
    ``image_requests``: the ids of requests with images; where
    ``shape.image_requests_per_step`` is set, a chunkscope engine takes them in at most that
    many a step, and the requests after one wait with it (the engine reads its commands in
    order).
    """
    changes = sorted(
        [(int(t), "token_budget", int(b)) for t, b in budget_changes]
        + [(int(t), "long_prefill_token_threshold", int(v)) for t, v in cap_changes],
        key=lambda c: c[0],
    )
    bm = BlockManager(shape.num_kv_blocks, shape.block_size, shape.enable_prefix_caching)
    max_budget = max(
        [shape.max_token_budget, token_budget, long_prefill_token_threshold]
        + [v for _, _, v in changes]
    )
    if shape.scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {shape.scheduler!r}")
    sched = (VllmV1Scheduler if shape.scheduler == "vllm" else Scheduler)(
        bm,
        token_budget=token_budget,
        max_token_budget=max_budget,
        policy=shape.policy,
        max_num_seqs=shape.max_num_seqs,
        max_model_len=shape.max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    setters = {
        "token_budget": sched.set_token_budget,
        "long_prefill_token_threshold": sched.set_long_prefill_token_threshold,
    }
    for tokens in warm_prefixes:
        _warm(bm, list(tokens))
    pending = sorted(requests, key=lambda r: r.arrival_ns)
    outcomes: dict[str, SimOutcome] = {}
    steps: list[SimStep] = []
    now = pending[0].arrival_ns if pending else 0
    start_ns = now
    i = c = 0
    num_steps = 0
    with_images = frozenset(image_requests)
    image_limit = shape.image_requests_per_step if shape.scheduler == "chunkscope" else 0
    while i < len(pending) or sched.has_unfinished():
        taken_images = 0
        while i < len(pending) and pending[i].arrival_ns <= now:
            r = pending[i]
            if r.request_id in with_images:
                if image_limit and taken_images >= image_limit:
                    break
                taken_images += 1
            sched.add(
                Request(
                    r.request_id,
                    list(r.prompt_token_ids),
                    SamplingParams(max_tokens=max(1, r.num_output_tokens), ignore_eos=True),
                    arrival_ns=r.arrival_ns,
                    traffic_class=r.traffic_class,
                )
            )
            outcomes[r.request_id] = SimOutcome(
                r.request_id,
                r.traffic_class,
                r.arrival_ns,
                len(r.prompt_token_ids),
            )
            i += 1
        while c < len(changes) and changes[c][0] <= now:
            result = setters[changes[c][1]](changes[c][2])
            if not result.accepted:
                raise ValueError(result.reason)
            c += 1
        if max_steps is not None and num_steps >= max_steps:
            break
        plan = sched.schedule()
        if plan.is_empty:
            if i < len(pending):
                # the next arrival (or, when requests wait behind an image taken in just now,
                # the same moment again: the engine reads its next command on its next loop)
                now = max(now, pending[i].arrival_ns)
                continue
            break  # work left that can never be scheduled (a request larger than the cache)
        for req in plan.preempted:
            outcomes[req.request_id].num_preemptions += 1
        for chunk in plan.chunks:
            o = outcomes[chunk.request_id]
            if o.first_scheduled_ns is None:
                o.first_scheduled_ns = now
        end = now + step_ns(plan)
        if record_steps:
            steps.append(
                SimStep(
                    plan.step,
                    plan.token_budget,
                    now,
                    end,
                    tuple(
                        SimChunk(
                            ch.request_id,
                            ch.kind,
                            ch.start,
                            ch.num_tokens,
                            ch.produces_token,
                            ch.capped,
                        )
                        for ch in plan.chunks
                    ),
                    len(plan.preempted),
                    plan.long_prefill_token_threshold,
                )
            )
        sampled = {ch.request_id: _SAMPLED_TOKEN for ch in plan.chunks if ch.produces_token}
        for req in sched.update(plan, sampled, end):
            outcomes[req.request_id].token_times_ns.append(end)
        num_steps += 1
        now = end + (gap_ns if isinstance(gap_ns, int) else gap_ns())
    unfinished = len(pending) - i + len(sched.waiting) + len(sched.running)
    if unfinished:
        logger.warning(
            "simulation at budget %d left %d requests unfinished", token_budget, unfinished
        )
    return SimResult(
        token_budget=token_budget,
        requests=[outcomes[r.request_id] for r in pending if r.request_id in outcomes],
        steps=steps,
        num_steps=num_steps,
        start_ns=start_ns,
        end_ns=now,
        unfinished=unfinished,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )


def _warm(bm: BlockManager, tokens: list[int]) -> None:
    """Put the full blocks of ``tokens`` in the prefix cache (as a finished request leaves them)."""
    if len(tokens) < bm.block_size:
        return
    req = Request("warm-prefix", tokens, SamplingParams(max_tokens=1), arrival_ns=0)
    hits = bm.find_cached_prefix(req)
    todo = len(tokens) - len(hits) * bm.block_size
    if not bm.can_allocate(req, todo, hits):
        return
    bm.allocate(req, todo, hits)
    req.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(req)
    bm.free(req)


# ---- figures ----------------------------------------------------------------------------------


def _pct(values: Sequence[float] | np.ndarray, q: float) -> float | None:
    a = np.asarray(values, dtype=float)
    return float(np.percentile(a, q)) if a.size else None


def latency_figures(
    ttft_s: dict[str | None, list[float]],
    itl_s: dict[str | None, list[float]],
    output_tokens: int,
    window_s: float,
    itl_class: str = ITL_CLASS,
) -> dict[str, Any]:
    """The sweep's figures from per-class TTFTs and token gaps (seconds): ITL of ``itl_class``
    (all classes when it has none) p50/p99/max, TTFT p50/p99 overall and by class, output
    tokens per second over ``window_s``. Milliseconds; None where there is no sample."""
    itl = itl_s.get(itl_class) or [g for gaps in itl_s.values() for g in gaps]
    ttft_all = [t for ts in ttft_s.values() for t in ts]
    ms = 1000.0

    def scaled(v: float | None) -> float | None:
        return None if v is None else v * ms

    return {
        "itl_class": itl_class if itl_s.get(itl_class) else "all",
        "itl_p50_ms": scaled(_pct(itl, 50)),
        "itl_p99_ms": scaled(_pct(itl, 99)),
        "itl_p999_ms": scaled(_pct(itl, 99.9)),
        "itl_max_ms": scaled(max(itl)) if itl else None,
        "ttft_p50_ms": scaled(_pct(ttft_all, 50)),
        "ttft_p99_ms": scaled(_pct(ttft_all, 99)),
        "ttft_by_class": {
            str(cls): {"ttft_p50_ms": scaled(_pct(v, 50)), "ttft_p99_ms": scaled(_pct(v, 99))}
            for cls, v in sorted(ttft_s.items(), key=lambda kv: str(kv[0]))
            if v
        },
        "num_ttft": len(ttft_all),
        "num_itl": len(itl),
        "output_tokens": int(output_tokens),
        "tokens_per_s": output_tokens / window_s if window_s > 0 else None,
    }


def figures(
    result: SimResult,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    itl_class: str = ITL_CLASS,
    client: Any = None,
) -> dict[str, Any]:
    """The sweep's figures over [since_ns, until_ns] of the simulation's clock (default: from
    the first to the last arrival): a gap counts where its later token falls, a TTFT where the
    first token falls, throughput is the tokens produced inside divided by the window.
    ``client`` (an ``advisor.client.ClientDraw``) adds the client's delivery to each TTFT and
    gap, as a load generator would see them."""
    arrivals = [o.arrival_ns for o in result.requests]
    lo = since_ns if since_ns is not None else (min(arrivals) if arrivals else 0)
    hi = until_ns if until_ns is not None else (max(arrivals) if arrivals else 0)
    if hi <= lo:  # one request, or every arrival at once: the whole run
        hi = max(result.end_ns, lo + 1)
    ttft: dict[str | None, list[float]] = {}
    itl: dict[str | None, list[float]] = {}
    tokens = 0
    for o in result.requests:
        t = o.token_times_ns
        if not t:
            continue
        if lo <= t[0] <= hi:
            first = (t[0] - o.arrival_ns) / 1e9
            ttft.setdefault(o.traffic_class, []).append(
                first if client is None else client.ttft(first)
            )
        gaps = itl.setdefault(o.traffic_class, [])
        for k in range(len(t)):
            if lo <= t[k] <= hi:
                tokens += 1
                if k > 0:
                    gap = (t[k] - t[k - 1]) / 1e9
                    gaps.append(gap if client is None else client.gap(gap))
    out = latency_figures(ttft, itl, tokens, (hi - lo) / 1e9, itl_class)
    out["unfinished"] = result.unfinished
    out["num_steps"] = result.num_steps
    out.update(window_load(result, lo, hi).to_dict())
    return out


def window_load(result: SimResult, lo: int, hi: int) -> WindowLoad:
    """The simulated window's load for ``advisor.overload``: a request is queued from its
    arrival to its first token (for ever when it never got one)."""
    firsts = [o.token_times_ns[0] if o.token_times_ns else None for o in result.requests]
    return judge([o.arrival_ns for o in result.requests], firsts, lo, hi)


def predict_budgets(
    requests: Sequence[SimRequest],
    shape: EngineShape,
    budgets: Sequence[int],
    *,
    timing: Callable[[], tuple[StepTime, int | GapTime]],
    warm_prefixes: Sequence[Sequence[int]] = (),
    itl_class: str = ITL_CLASS,
    max_steps: int | None = None,
    window_ns: tuple[int, int] | None = None,
    client: Callable[[], Any] | None = None,
    caps: Sequence[int] = (0,),
    image_requests: Collection[str] = (),
) -> list[dict[str, Any]]:
    """One figures dict per (budget, cap) (``budget`` and ``cap`` first; a cap at or above the
    budget is skipped: it cuts nothing), each from its own simulation over ``window_ns``
    (default: first to last arrival); ``timing()`` gives each simulation its (step time, pause)
    functions afresh (so that seeded draws are the same at every budget)."""
    from advisor.text import pairs_of

    out = []
    for b, cap in pairs_of(budgets, caps):
        step_ns, gap_ns = timing()
        res = simulate(
            requests,
            shape,
            token_budget=int(b),
            step_ns=step_ns,
            gap_ns=gap_ns,
            warm_prefixes=warm_prefixes,
            max_steps=max_steps,
            long_prefill_token_threshold=cap,
            image_requests=image_requests,
        )
        lo, hi = window_ns if window_ns is not None else (None, None)
        draw = client() if client is not None else None
        out.append(
            {
                "budget": int(b),
                "cap": int(cap),
                **figures(res, since_ns=lo, until_ns=hi, itl_class=itl_class, client=draw),
            }
        )
    return out
