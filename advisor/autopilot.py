"""The autopilot's decision: which (token budget, long-prefill cap) to run for the next window.

Pure and torch-free: it is given the fitted step-cost model (``advisor.fit.FitReport``, or why
none could be fitted), the traffic of the recent past (``advisor.traffic.Traffic``: the requests
that arrived in the look-back window, the queued ones included), the engine's shape and what was
observed over that window, and returns a :class:`Decision`. ``advisor.autopilot_run`` reads the
store and steers; this module never does I/O.

How it decides, every tick:

1. **Enough to go on?** Fewer than ``min_requests`` arrivals in the look-back, or a fit on fewer
   than ``min_steps`` steps: no decision (``refuse``, "too little data"). A fit whose relative
   error p50 is above ``max_fit_err`` or whose R^2 is below ``min_fit_r2``: no decision
   ("poor fit").
2. **Predict each candidate**: the look-back's requests (with the backlog that still waited for
   a first token at its start, ``advisor.autopilot_run.recent_traffic``) are replayed through
   the engine's own scheduler (``advisor.simulate.simulate``) at each supported (budget, cap),
   step times drawn from the fit with its measured scatter (the same seeded draws for every
   candidate). The recent past stands for the next window. A request *meets the SLOs*
   (:func:`request_meets`) when its TTFT is within its class's TTFT SLO, the p99 of its own
   token gaps within the ITL SLO and (when set) its longest gap within the tail SLO.
3. **Do predictions still hold?** When the engine ran one setting through the whole look-back,
   the prediction for that setting is compared with what was observed (chat ITL p99 and TTFT
   p99); off by more than ``part_tolerance`` (relative, above a floor), where one of the two
   is past the SLO (``part_slo_share`` of it: while both are within it, model and measurement
   agree the SLO holds), for ``part_ticks`` ticks in a row and for at least ``part_span_s``
   (the runner: one look-back, so the evidence is not one window seen a few times over), and
   the autopilot falls back to the operator's starting setting and stays there for
   ``fallback_hold_s`` (``fallback``, saying so).
4. **Pick**: most requests predicted to meet the SLOs; ties to the one with more requests whose
   every token gap stays within the ITL SLO (``num_meet_tail``: a request whose p99 met the SLO
   but one of whose gaps did not is one stall from missing it), then the readier for a long
   prompt (step 5), then the lower predicted tail (longest gap), then the smaller change from
   the current setting. **Hysteresis**: it moves only when the pick beats the current setting
   by at least ``margin`` requests (``max(1, margin_frac * n)``) meeting the SLOs, or meets as
   many and beats it by ``margin`` on ``num_meet_tail``, or loses nothing on either and is
   readier; the current setting was beaten so on ``confirm`` ticks in a row, by candidates on
   the same side of it (smaller or larger: near-equal settings trade first place from draw to
   draw, while winners on both sides are noise), or on one tick when the pick gains
   ``fast_margins`` margins or more (a burst the current setting is predicted to fail badly is
   not noise, and a tick's wait is a share of the burst); and ``min_dwell_s`` passed since the
   last change; otherwise it holds.
5. **Ready for a long prompt**: the stall a prompt of ``probe_tokens`` tokens (default: the
   engine's ``max_model_len``) arriving now would cause a decoding stream: its costliest chunk
   step (at most the budget less the stream's token, and the cap), with the stream's own token
   and the pause between steps, predicted by the fit (:func:`probe_stall_ms`). A setting is
   *ready* when that stall is within the ITL SLO; otherwise its *readiness* is how many
   doublings of the SLO the stall needs (-1: within 2x, -2: within 4x, ...; settings within
   the same factor of two are equally ready, so a refit's wobble moves nothing). Among settings
   tied on both counts above, the readier come first. In quiet traffic every setting ties, and
   without this the autopilot sat at the operator's 2048 until a RAG burst's first prompts had
   stalled the chat streams (on seeds 0 and 1 of ``autopilot_load15b.json`` it moved 2.7 s
   and 5 s into the burst). The traffic in the look-back still decides whenever it tells the
   settings apart: a setting that serves more requests wins, ready or not. Among settings
   equally ready for one prompt, the readier for several arriving together comes first
   (``burst_readiness``: their chunks fill a step up to the budget whatever the cap, which
   bounds each prompt's chunk, not their sum). Without it the autopilot rested at 2048 cap 256
   as ready as 256 for one prompt, and a burst of 28 RAG prompts on vLLM filled its steps to
   2,048 tokens (seed 1 of ``autopilot_vllm.json``: 72 of the burst's 81 requests met, 81 at
   1024 cap 256).
6. **An overloaded window** (its queue grew through it, or requests failed: ``advisor.overload``)
   is never read as what a setting does: its observed figures say how long the queue was, and
   its arrivals are what the engine took in, which understates what was offered. The parting
   check (step 3) skips it, and the only move made from it is toward more prefill per step (a
   larger budget, a larger cap or none: fewer steps for the same prompts, so more throughput),
   when step 4's rule picks one among those settings, readiness aside (the readier settings
   prefill less per step). Otherwise it holds (``refuse``, saying why). Only the current
   setting and those that prefill more are simulated then: the others cannot be chosen, and
   they are the costliest to simulate (more steps for the same queue) when the engine, short
   of CPU, can least spare it. Before, it made no move at all: in a RAG burst on vLLM (seed 1
   of ``autopilot_vllm_burst.json``) nine refusals held 512 cap 256 for 14 s while the queue
   grew, and the move to 1024 cap 256, made once a window was no longer overloaded, came late
   for nine of the burst's requests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from advisor.fit import FitReport
from advisor.overload import WindowLoad
from advisor.predict import image_share_of, step_timing
from advisor.simulate import ITL_CLASS, UNKNOWN_MODEL_LEN, EngineShape, SimResult, simulate
from advisor.traffic import Traffic, to_sim_requests
from engine.core.cost_model import StepWork, chunk_pairs

KINDS = ("change", "hold", "refuse", "fallback")


@dataclass(frozen=True)
class AutopilotSlo:
    """The operator's SLOs: chat ITL p99 and TTFT p99 (per class when ``ttft_by_class`` names
    it), and optionally the stall tail (each request's longest token gap)."""

    itl_ms: float
    ttft_ms: float
    tail_itl_ms: float | None = None
    ttft_by_class: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, v in (("itl_ms", self.itl_ms), ("ttft_ms", self.ttft_ms)):
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {v!r}")
        if self.tail_itl_ms is not None and not self.tail_itl_ms > 0:
            raise ValueError(f"tail_itl_ms must be positive, got {self.tail_itl_ms!r}")
        for cls, v in self.ttft_by_class.items():
            if not (isinstance(v, int | float) and v > 0):
                raise ValueError(f"TTFT SLO of class {cls!r} must be positive, got {v!r}")

    def ttft_for(self, traffic_class: str | None) -> float:
        return float(self.ttft_by_class.get(str(traffic_class), self.ttft_ms))

    def text(self) -> str:
        parts = [f"ITL p99 <= {self.itl_ms:g} ms", f"TTFT p99 <= {self.ttft_ms:g} ms"]
        if self.tail_itl_ms is not None:
            parts.append(f"ITL max <= {self.tail_itl_ms:g} ms")
        parts += [f"{c} TTFT <= {v:g} ms" for c, v in sorted(self.ttft_by_class.items())]
        return ", ".join(parts)


def request_meets(
    ttft_s: float | None, gaps_s: Sequence[float], slo: AutopilotSlo, traffic_class: str | None
) -> bool:
    """Whether one request met the SLOs: it produced a first token within its class's TTFT
    SLO, the p99 of its token gaps is within the ITL SLO and its longest gap within the tail
    SLO (when set). The goodput of a run counts these; the benchmark applies the same rule to
    what the client measured."""
    if ttft_s is None or ttft_s * 1e3 > slo.ttft_for(traffic_class):
        return False
    if len(gaps_s):
        g = np.asarray(gaps_s, dtype=float) * 1e3
        if float(np.percentile(g, 99)) > slo.itl_ms:
            return False
        if slo.tail_itl_ms is not None and float(g.max()) > slo.tail_itl_ms:
            return False
    return True


@dataclass(frozen=True, order=True)
class Setting:
    budget: int
    cap: int = 0  # long_prefill_token_threshold, 0 = off

    def label(self) -> str:
        return f"budget {self.budget} cap {self.cap or 'off'}"

    def side_of(self, other: Setting) -> int:
        """-1 when this setting prefills less per step than ``other`` (a smaller budget, or the
        same budget with a smaller cap), +1 when more, 0 when it is ``other``."""
        mine = (self.budget, self.cap or self.budget)
        theirs = (other.budget, other.cap or other.budget)
        return (mine > theirs) - (mine < theirs)

    def distance(self, other: Setting) -> float:
        """How big a change from ``other`` is (log2 steps of budget and of cap)."""
        return abs(math.log2(self.budget / other.budget)) + abs(
            math.log2((self.cap or other.budget) / (other.cap or other.budget))
        )


def candidates(
    budgets: Sequence[int],
    caps: Sequence[int],
    *,
    max_token_budget: int | None,
    cap_supported: bool,
) -> list[Setting]:
    """The grid the engine supports: budgets up to its maximum, caps (0 = off) only where it
    has the control and below the budget (a cap at or above the budget cuts nothing)."""
    out = set()
    for b in budgets:
        if b < 1 or (max_token_budget is not None and b > max_token_budget):
            continue
        for c in caps if cap_supported else (0,):
            if c == 0 or 0 < c < b:
                out.add(Setting(int(b), int(c)))
    if not out:
        raise ValueError(
            f"no candidate setting is supported: budgets {list(budgets)} against the engine's "
            f"maximum {max_token_budget}"
        )
    return sorted(out)


@dataclass(frozen=True)
class Prediction:
    setting: Setting
    num_requests: int
    num_meet: int
    itl_p99_ms: float | None  # chat (all classes when there is no chat) token gaps, pooled
    itl_max_ms: float | None
    ttft_p99_ms: float | None
    unfinished: int
    # as far as the store can have seen it at the window's end (the check against observations):
    # gaps whose later token came by then, TTFT cut at then for requests still waiting
    itl_seen_p99_ms: float | None = None
    ttft_seen_p99_ms: float | None = None
    # of num_meet, those whose longest token gap is also within the ITL SLO
    num_meet_tail: int | None = None
    # the longest gap a stream would wait through were a probe prompt to arrive now
    # (:func:`probe_stall_ms`), and its readiness: 0 within the ITL SLO, -k within 2^k times
    # it (None: no probe)
    probe_stall_ms: float | None = None
    readiness: int | None = None
    # several such prompts arriving together: a step then carries up to the budget in prefill
    # chunks whatever the cap (the cap bounds each prompt's chunk, not their sum), so its stall
    # is the probe's at the setting without its cap; and its readiness, counted the same way
    burst_stall_ms: float | None = None
    burst_readiness: int | None = None
    # the probe's costliest step lies beyond any step the fit was fitted on (its figure is an
    # extrapolation; the order of the settings' stalls holds whatever the costs: a larger chunk
    # costs more)
    probe_extrapolated: bool | None = None

    def brief(self) -> str:
        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.0f}"

        return (
            f"chat ITL p99 {ms(self.itl_p99_ms)} ms, TTFT p99 {ms(self.ttft_p99_ms)} ms, "
            f"{self.num_meet}/{self.num_requests} meet"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.setting.budget,
            "cap": self.setting.cap,
            "num_requests": self.num_requests,
            "num_meet": self.num_meet,
            "itl_p99_ms": self.itl_p99_ms,
            "itl_max_ms": self.itl_max_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "unfinished": self.unfinished,
            "itl_seen_p99_ms": self.itl_seen_p99_ms,
            "ttft_seen_p99_ms": self.ttft_seen_p99_ms,
            "num_meet_tail": self.num_meet_tail,
            "probe_stall_ms": self.probe_stall_ms,
            "readiness": self.readiness,
            "probe_extrapolated": self.probe_extrapolated,
            "burst_stall_ms": self.burst_stall_ms,
            "burst_readiness": self.burst_readiness,
        }

    def ready_key(self) -> tuple[int, int]:
        """How ready it is for long prompts: for one (``readiness``), then for several at once
        (``burst_readiness``); (0, 0) without a probe."""
        return self.readiness or 0, self.burst_readiness or 0

    def meet_key(self) -> tuple[int, int]:
        """What the pick maximizes first: requests meeting the SLOs, then those of them whose
        every gap is within the ITL SLO."""
        tail = self.num_meet if self.num_meet_tail is None else self.num_meet_tail
        return self.num_meet, tail


def probe_stall_ms(
    fit: FitReport, setting: Setting, prompt_tokens: int, stream_context: int = 0
) -> float:
    """The longest token gap (ms) a decoding stream would see while a prompt of ``prompt_tokens``
    tokens (none cached) is prefilled at ``setting``: the predicted cost of its costliest chunk
    step (the stream's token first, then a chunk of at most the budget less that token, and at
    most the cap), plus the pause between steps. ``stream_context``: the stream's own context
    (its decode token reads it)."""
    worst = _probe_worst(fit, setting, prompt_tokens, stream_context)
    return (fit.step_seconds(worst) + fit.step_gap_s) * 1e3


def _probe_worst(
    fit: FitReport, setting: Setting, prompt_tokens: int, stream_context: int
) -> StepWork:
    """The costliest chunk step of the probe (see :func:`probe_stall_ms`)."""
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
    chunk = max(1, setting.budget - 1)
    if setting.cap:
        chunk = min(chunk, setting.cap)
    worst, cost, start = None, -1.0, 0
    while start < prompt_tokens:
        n = min(chunk, prompt_tokens - start)
        work = StepWork(
            prefill_tokens=n,
            decode_tokens=1,
            attention_pairs=chunk_pairs(start, n) + stream_context + 1,
            decode_pairs=stream_context + 1,
        )
        c = fit.step_seconds(work)
        if c > cost:
            worst, cost = work, c
        start += n
    assert worst is not None
    return worst


def probe_extrapolated(
    fit: FitReport, setting: Setting, prompt_tokens: int, stream_context: int = 0
) -> bool | None:
    """Whether the probe's costliest step holds more than twice the prefill tokens or the
    attention pairs of the largest step the fit was fitted on (``FitReport.seen``; None when
    the fit does not say)."""
    return _beyond_seen(fit, _probe_worst(fit, setting, prompt_tokens, stream_context))


def _beyond_seen(fit: FitReport, work: StepWork) -> bool | None:
    seen_tokens, seen_pairs = fit.seen.get("prefill_tokens"), fit.seen.get("attention_pairs")
    if not seen_tokens or not seen_pairs:
        return None
    return work.prefill_tokens > 2 * seen_tokens or work.attention_pairs > 2 * seen_pairs


def readiness(stall_ms: float, itl_slo_ms: float) -> int:
    """0 when ``stall_ms`` is within the SLO, else -k for the least k with the stall within
    ``2**k`` times it."""
    if stall_ms <= itl_slo_ms:
        return 0
    return -math.ceil(math.log2(stall_ms / itl_slo_ms))


def _with_probe(
    preds: Sequence[Prediction], fit: FitReport, tokens: int, context: int, slo: AutopilotSlo
) -> list[Prediction]:
    out = []
    for p in preds:
        worst = _probe_worst(fit, p.setting, tokens, context)
        stall = (fit.step_seconds(worst) + fit.step_gap_s) * 1e3
        burst = probe_stall_ms(fit, Setting(p.setting.budget), tokens, context)
        out.append(
            replace(
                p,
                probe_stall_ms=stall,
                readiness=readiness(stall, slo.itl_ms),
                probe_extrapolated=_beyond_seen(fit, worst),
                burst_stall_ms=burst,
                burst_readiness=readiness(burst, slo.itl_ms),
            )
        )
    return out


def _extrapolation_note(fit: FitReport, best: Prediction, here: Prediction) -> str:
    """What a readying move's reason adds when a stall it names is an extrapolation."""
    if not (best.probe_extrapolated or here.probe_extrapolated):
        return ""
    return (
        f"; predicted past the largest step the fit has seen ({fit.seen['prefill_tokens']} "
        "prefill tokens): the figures may be far off, their order holds"
    )


def _stream_context(traffic: Traffic) -> int:
    """A chat stream's context for the probe: the median prompt plus output of the look-back's
    chat requests (all requests without chat; 0 without requests)."""
    reqs = [r for r in traffic.requests if r.traffic_class == ITL_CLASS] or traffic.requests
    if not reqs:
        return 0
    return int(np.median([r.num_prompt_tokens + r.num_output_tokens for r in reqs]))


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def _score(
    result: SimResult, setting: Setting, slo: AutopilotSlo, horizon_ns: int | None = None
) -> Prediction:
    """The prediction's figures; with ``horizon_ns`` (the window's end on the simulation's
    clock) also what the store can have seen by then, to compare with what it saw."""
    chat: list[float] = []
    everyone: list[float] = []
    ttfts: list[float] = []
    chat_seen: list[float] = []
    all_seen: list[float] = []
    ttft_seen: list[float] = []
    meet = 0
    meet_tail = 0
    for o in result.requests:
        t = o.token_times_ns
        ttft = (t[0] - o.arrival_ns) / 1e9 if t else None
        arr = np.asarray(t, dtype=np.int64)
        gaps = list(np.diff(arr) / 1e9) if len(t) > 1 else []
        if ttft is not None:
            ttfts.append(ttft * 1e3)
        everyone += gaps
        if o.traffic_class == ITL_CLASS:
            chat += gaps
        ok = request_meets(ttft, gaps, slo, o.traffic_class)
        meet += ok
        meet_tail += bool(ok and (not gaps or float(max(gaps)) * 1e3 <= slo.itl_ms))
        if horizon_ns is not None and o.arrival_ns <= horizon_ns:
            first = t[0] if t else horizon_ns
            ttft_seen.append((min(first, horizon_ns) - o.arrival_ns) / 1e6)
            seen = [g * 1e3 for g, end in zip(gaps, arr[1:], strict=False) if end <= horizon_ns]
            all_seen += seen
            if o.traffic_class == ITL_CLASS:
                chat_seen += seen
    itl = np.asarray(chat or everyone, dtype=float) * 1e3
    return Prediction(
        setting=setting,
        num_requests=len(result.requests),
        num_meet=int(meet),
        itl_p99_ms=float(np.percentile(itl, 99)) if itl.size else None,
        itl_max_ms=float(itl.max()) if itl.size else None,
        ttft_p99_ms=_p99(ttfts),
        unfinished=result.unfinished,
        itl_seen_p99_ms=_p99(chat_seen or all_seen),
        ttft_seen_p99_ms=_p99(ttft_seen),
        num_meet_tail=int(meet_tail),
    )


def simulate_settings(
    report: FitReport,
    traffic: Traffic,
    shape: EngineShape,
    settings: Sequence[Setting],
    *,
    seed: int = 0,
    max_steps: int = 200_000,
) -> list[SimResult]:
    """Replay ``traffic`` at each setting through the engine's scheduler (the advisor's
    simulator), step times from ``report`` with its scatter (image requests' steps with the
    fit's vision term, as the advisor predicts), the same draws for each."""
    reqs, warm = to_sim_requests(traffic, shape.block_size)
    shares = image_share_of(traffic)  # the vision term's cost per request
    out = []
    for s in settings:
        step_ns, gap_ns = step_timing(report, seed=seed, image_share=shares)
        out.append(
            simulate(
                reqs,
                shape,
                token_budget=s.budget,
                step_ns=step_ns,
                gap_ns=gap_ns,
                warm_prefixes=warm,
                max_steps=max_steps,
                long_prefill_token_threshold=s.cap,
                image_requests=shares.keys(),
            )
        )
    return out


def predict_settings(
    report: FitReport,
    traffic: Traffic,
    shape: EngineShape,
    settings: Sequence[Setting],
    slo: AutopilotSlo,
    *,
    seed: int = 0,
    max_steps: int = 200_000,
) -> list[Prediction]:
    """Each setting's :class:`Prediction` from :func:`simulate_settings`."""
    runs = simulate_settings(report, traffic, shape, settings, seed=seed, max_steps=max_steps)
    horizon = round(traffic.duration_s * 1e9)
    return [_score(res, s, slo, horizon) for res, s in zip(runs, settings, strict=True)]


@dataclass(frozen=True)
class Observed:
    """What the store saw over the look-back window."""

    itl_p99_ms: float | None
    ttft_p99_ms: float | None
    num_requests: int = 0
    steady: bool = True  # the engine ran one setting through the whole window


@dataclass(frozen=True)
class AutopilotConfig:
    candidates: tuple[Setting, ...]
    start: Setting  # the operator's setting: the fallback
    min_requests: int = 5
    min_steps: int = 40
    max_fit_err: float = 0.6  # relative error p50 of the fit on its steps
    min_fit_r2: float = 0.5
    margin_frac: float = 0.05
    confirm: int = 2
    fast_margins: int = 3  # a gain of this many margins moves after one tick
    min_dwell_s: float = 4.0
    part_tolerance: float = 0.5
    part_ticks: int = 3
    part_span_s: float = 0.0  # and parted this long: ticks a second apart see one window
    part_floor_itl_ms: float = 10.0
    part_floor_ttft_ms: float = 200.0
    part_slo_share: float = 1.0  # parting while both are below this share of the SLO: ignored
    fallback_hold_s: float = 60.0
    seed: int = 0
    # the prompt a setting must be ready for (see the module docstring, step 5); None: the
    # engine's max_model_len (no probe where the engine does not report it), 0: no probe
    probe_tokens: int | None = None


@dataclass(frozen=True)
class Decision:
    kind: str  # one of KINDS
    setting: Setting  # where the engine should be after this tick
    previous: Setting
    reason: str
    chosen: Prediction | None = None
    left: Prediction | None = None
    predictions: tuple[Prediction, ...] = ()

    @property
    def changes(self) -> bool:
        return self.setting != self.previous

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "budget": self.setting.budget,
            "cap": self.setting.cap,
            "previous_budget": self.previous.budget,
            "previous_cap": self.previous.cap,
            "reason": self.reason,
            "chosen": None if self.chosen is None else self.chosen.to_dict(),
            "left": None if self.left is None else self.left.to_dict(),
            "predictions": [p.to_dict() for p in self.predictions],
        }


def change_reason(chosen: Prediction, left: Prediction, why: str = "") -> str:
    """The reason of a change: what it predicts for the chosen setting and for the one left
    (:func:`parse_reason` reads the predicted numbers back for the Live page)."""
    return (
        f"autopilot: {left.setting.label()} -> {chosen.setting.label()}{why}: predicted "
        f"{chosen.brief()}; left {left.setting.label()}: predicted {left.brief()}"
    )


_PRED = re.compile(r"predicted chat ITL p99 (\S+) ms, TTFT p99 (\S+) ms")


def parse_reason(reason: str | None) -> tuple[float | None, float | None]:
    """The predicted chat ITL p99 and TTFT p99 (ms) of the setting an autopilot control event
    chose or held (the first prediction in its reason); None where it names none."""
    m = _PRED.search(reason or "")
    if m is None:
        return None, None

    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None

    return num(m.group(1)), num(m.group(2))


def _parted(pred: Prediction, obs: Observed, cfg: AutopilotConfig, slo: AutopilotSlo) -> str | None:
    """Why the prediction for the running setting and the observation part, or None. They part
    when they differ by more than ``part_tolerance`` (relative, above a floor) where it matters:
    one of them past ``part_slo_share`` of the SLO (a model that says 160 ms where 45 ms were
    measured, under a 250 ms SLO, agrees with the measurement that the SLO holds)."""
    ttft_slo = min([slo.ttft_ms, *slo.ttft_by_class.values()])
    itl = pred.itl_seen_p99_ms if pred.itl_seen_p99_ms is not None else pred.itl_p99_ms
    ttft = pred.ttft_seen_p99_ms if pred.ttft_seen_p99_ms is not None else pred.ttft_p99_ms
    for name, p, o, floor, bound in (
        ("chat ITL p99", itl, obs.itl_p99_ms, cfg.part_floor_itl_ms, slo.itl_ms),
        ("TTFT p99", ttft, obs.ttft_p99_ms, cfg.part_floor_ttft_ms, ttft_slo),
    ):
        if p is None or o is None:
            continue
        if max(p, o) < cfg.part_slo_share * bound:
            continue
        if abs(o - p) > cfg.part_tolerance * max(p, floor):
            return f"{name} predicted {p:.0f} ms, observed {o:.0f} ms"
    return None


class Autopilot:
    """The stateful part of the decision (hysteresis, fallback); see the module docstring."""

    def __init__(self, config: AutopilotConfig, slo: AutopilotSlo) -> None:
        if config.start not in config.candidates:
            config = AutopilotConfig(
                **{**config.__dict__, "candidates": (*config.candidates, config.start)}
            )
        self.config = config
        self.slo = slo
        self.current = config.start
        # ticks in a row on which the current setting was beaten by a candidate on the same side
        # of it (among near-equal small budgets the noise draws change the winner from tick to
        # tick, and a count of the same winner restarted at every burst's start; winners on
        # both sides are noise, and counting them let a small window flap 256 -> 512 -> 256)
        self._beaten_ticks = 0
        self._beaten_side = 0
        self._last_change: float | None = None
        self._parted_ticks = 0
        self._parted_since: float | None = None
        self._fallback_until: float | None = None
        self._ticks = 0  # predicting ticks: each draws its own step-time scatter

    def probe_tokens(self, shape: EngineShape) -> int:
        """The prompt length settings must be ready for (0: no probe)."""
        if self.config.probe_tokens is not None:
            return max(0, self.config.probe_tokens)
        return shape.max_model_len - 1 if shape.max_model_len < UNKNOWN_MODEL_LEN else 0

    def moved(self, setting: Setting, now: float) -> None:
        """The engine is now at ``setting`` (the runner applied a decision)."""
        if setting != self.current:
            self._last_change = now
        self.current = setting

    def _gains(self, best: Prediction, here: Prediction, n: int) -> tuple[int, int, int, bool]:
        """Step 4's hysteresis: the margin (requests), ``best``'s gain over ``here`` in requests
        meeting the SLOs and in ``num_meet_tail``, and whether that is enough to move."""
        margin = max(1, math.ceil(self.config.margin_frac * n))
        gain = best.num_meet - here.num_meet
        gain_tail = best.meet_key()[1] - here.meet_key()[1]
        return margin, gain, gain_tail, gain >= margin or (gain >= 0 and gain_tail >= margin)

    def _dwelt(self, now: float) -> bool:
        """``min_dwell_s`` has passed since the last move (or there was none)."""
        return self._last_change is None or now - self._last_change >= self.config.min_dwell_s

    def _overloaded(
        self, now: float, why: str, preds: list[Prediction], here: Prediction, n: int
    ) -> Decision:
        """Step 6: from an overloaded window, step 4's rule among the settings that prefill
        more per step than the current one (readiness aside), or a hold."""
        cfg, cur = self.config, self.current
        up = [p for p in preds if p.setting.side_of(cur) > 0]

        def rank(p: Prediction) -> tuple[Any, ...]:
            return (
                *p.meet_key(),
                -(p.itl_max_ms if p.itl_max_ms is not None else math.inf),
                -p.setting.distance(cur),
            )

        best = max(up, key=rank) if up else here
        margin, gain, gain_tail, enough = self._gains(best, here, n)
        enough = enough and best is not here
        if enough and self._beaten_side == 1:
            self._beaten_ticks += 1
        else:
            self._beaten_ticks, self._beaten_side = int(enough), int(enough)
        confirm = 1 if gain >= cfg.fast_margins * margin else cfg.confirm
        dwell = self._dwelt(now)
        if enough and self._beaten_ticks >= confirm and dwell:
            self._beaten_ticks = 0
            more = (
                f"{gain} more of {n} requests meet {self.slo.text()}"
                if gain >= margin
                else f"as many of {n} requests meet {self.slo.text()}; {gain_tail} more keep "
                f"every token gap within {self.slo.itl_ms:g} ms"
            )
            return Decision(
                "change",
                best.setting,
                cur,
                change_reason(
                    best,
                    here,
                    f" (the window is overloaded ({why}): only a move to more prefill per "
                    f"step is made from it; {more})",
                ),
                chosen=best,
                left=here,
                predictions=tuple(preds),
            )
        if not enough:
            wait = (
                "no setting with more prefill per step is predicted to meet more requests"
                if up
                else "no setting prefills more per step"
            )
        elif not dwell:
            wait = f"{best.setting.label()} waits out the {cfg.min_dwell_s:g} s dwell"
        else:
            wait = f"{best.setting.label()} needs {confirm} ticks in a row"
        return Decision(
            "refuse",
            cur,
            cur,
            f"autopilot holds {cur.label()}: the window is overloaded ({why}); only a move to "
            f"more prefill per step is made from it, and {wait}",
            left=here,
            predictions=tuple(preds),
        )

    def decide(
        self,
        now: float,
        fit: FitReport | str,
        traffic: Traffic,
        shape: EngineShape,
        observed: Observed | None = None,
        load: WindowLoad | None = None,
    ) -> Decision:
        """One tick. ``load`` is the look-back window's load (``advisor.overload``): from an
        overloaded window only a move toward more prefill per step is made (step 6 of the
        module docstring); the sweep and the advisor recommend nothing from one."""
        held = self._held_for_data(now, traffic)
        if held is not None:
            return held
        if isinstance(fit, str):
            return self._keep(
                "refuse", f"autopilot holds {self.current.label()}: too little data ({fit})"
            )
        overloaded = load.reason() if load is not None and load.overloaded else None
        held = self._held_for_fit(fit)
        if held is not None:
            return held
        self._ticks += 1
        probe = self.probe_tokens(shape)
        preds = self._predict(fit, traffic, shape, probe, overloaded=overloaded is not None)
        by = {p.setting: p for p in preds}
        here = by[self.current]
        n = len(traffic.requests)
        if overloaded is not None:
            return self._overloaded(now, overloaded, preds, here, n)
        parted = self._parting(now, observed, by, preds)
        if parted is not None:
            return parted
        return self._move_or_hold(now, fit, preds, here, n, probe)

    def _keep(self, kind: str, reason: str, **kw: Any) -> Decision:
        """A decision of ``kind`` that keeps the current setting."""
        return Decision(kind, self.current, self.current, reason, **kw)

    def _held_for_data(self, now: float, traffic: Traffic) -> Decision | None:
        """Step 1 (and step 3's hold): hold while a fallback lasts, or on too few requests in
        the look-back; None to go on."""
        cfg, cur = self.config, self.current
        if self._fallback_until is not None and now < self._fallback_until:
            return self._keep(
                "fallback",
                f"autopilot holds {cur.label()} (the operator's setting) after predictions and "
                f"observations parted; resumes in {self._fallback_until - now:.0f} s",
            )
        self._fallback_until = None
        n = len(traffic.requests)
        if n < cfg.min_requests:
            self._beaten_ticks = 0
            return self._keep(
                "refuse",
                f"autopilot holds {cur.label()}: too little data ({n} requests in the last "
                f"{traffic.duration_s:.0f} s, needs {cfg.min_requests})",
            )
        return None

    def _held_for_fit(self, fit: FitReport) -> Decision | None:
        """Step 1: refuse on a fit over too few steps, or a poor one; None to go on."""
        cfg, cur = self.config, self.current
        if fit.num_steps < cfg.min_steps:
            return self._keep(
                "refuse",
                f"autopilot holds {cur.label()}: too little data (fit on {fit.num_steps} steps, "
                f"needs {cfg.min_steps})",
            )
        err, r2 = fit.model.rel_err_p50, fit.model.r2
        if err > cfg.max_fit_err or r2 < cfg.min_fit_r2:
            return self._keep(
                "refuse",
                f"autopilot holds {cur.label()}: poor fit of the step-cost model (relative "
                f"error p50 {err:.0%}, R^2 {r2:.2f}; needs <= {cfg.max_fit_err:.0%} and >= "
                f"{cfg.min_fit_r2:.2f})",
            )
        return None

    def _predict(
        self,
        fit: FitReport,
        traffic: Traffic,
        shape: EngineShape,
        probe: int,
        *,
        overloaded: bool,
    ) -> list[Prediction]:
        """Step 2 (and step 5's probe): the predictions for the candidates worth simulating,
        the current setting always among them."""
        cfg, cur = self.config, self.current
        # from an overloaded window only a move to more prefill per step can be made (step 6):
        # the settings that prefill less are not simulated. They are the costly ones (more
        # steps for the same queue), and a tick in a burst takes its CPU from the engine
        pool = (
            [c for c in cfg.candidates if c.side_of(cur) >= 0]
            if overloaded
            else list(cfg.candidates)
        )
        if cur not in pool:
            pool.append(cur)
        preds = predict_settings(fit, traffic, shape, pool, self.slo, seed=cfg.seed + self._ticks)
        if probe:
            preds = _with_probe(preds, fit, probe, _stream_context(traffic), self.slo)
        return preds

    def _parting(
        self,
        now: float,
        observed: Observed | None,
        by: dict[Setting, Prediction],
        preds: list[Prediction],
    ) -> Decision | None:
        """Step 3: fall back to the operator's setting (or, already there, refuse) once the
        prediction for the running setting and the observation have parted long enough; None
        to go on."""
        cfg, cur = self.config, self.current
        here = by[cur]
        steady = observed is not None and observed.steady
        parted = _parted(here, observed, cfg, self.slo) if steady and observed else None
        self._parted_ticks = self._parted_ticks + 1 if parted else 0
        if not parted:
            self._parted_since = None
        elif self._parted_since is None:
            self._parted_since = now
        span = now - self._parted_since if self._parted_since is not None else 0.0
        if not (parted and self._parted_ticks >= cfg.part_ticks and span >= cfg.part_span_s):
            return None
        self._parted_ticks = 0
        self._parted_since = None
        self._beaten_ticks = 0
        if cur != cfg.start:
            self._fallback_until = now + cfg.fallback_hold_s
            back = by[cfg.start]
            return Decision(
                "fallback",
                cfg.start,
                cur,
                f"autopilot falls back to the operator's {cfg.start.label()}: predictions "
                f"and observations parted ({parted}) for {cfg.part_ticks} ticks over "
                f"{span:.0f} s; "
                f"predicted {back.brief()}; left {cur.label()}: predicted {here.brief()}",
                chosen=back,
                left=here,
                predictions=tuple(preds),
            )
        return self._keep(
            "refuse",
            f"autopilot holds {cur.label()} (the operator's setting): predictions and "
            f"observations part ({parted})",
            left=here,
            predictions=tuple(preds),
        )

    def _move_or_hold(
        self,
        now: float,
        fit: FitReport,
        preds: list[Prediction],
        here: Prediction,
        n: int,
        probe: int,
    ) -> Decision:
        """Step 4's hysteresis: move to the pick once it has beaten the current setting long
        enough and the dwell is over, else hold."""
        cfg, cur = self.config, self.current
        best, readying, gains = self._pick(preds, here, n)
        margin, gain, _, enough = gains
        confirm = 1 if gain >= cfg.fast_margins * margin else cfg.confirm
        beaten = best.setting != cur and enough
        side = best.setting.side_of(cur) if beaten else 0
        if beaten and side == self._beaten_side:
            self._beaten_ticks += 1
        else:
            self._beaten_ticks, self._beaten_side = int(beaten), side
        dwell = self._dwelt(now)
        if beaten and self._beaten_ticks >= confirm and dwell:
            self._beaten_ticks = 0
            why = self._change_why(fit, best, here, n, probe, readying=readying, gains=gains)
            return Decision(
                "change",
                best.setting,
                cur,
                change_reason(best, here, why),
                chosen=best,
                left=here,
                predictions=tuple(preds),
            )
        return self._keep(
            "hold",
            f"autopilot holds {cur.label()}: predicted {here.brief()}; "
            f"{self._hold_why(best, gains, dwell=dwell, confirm=confirm)}",
            chosen=here,
            left=here,
            predictions=tuple(preds),
        )

    def _pick(
        self, preds: list[Prediction], here: Prediction, n: int
    ) -> tuple[Prediction, bool, tuple[int, int, int, bool]]:
        """Step 4's pick (step 5's readiness among its ties), whether it was picked for
        readiness alone, and its gains over the current setting (see ``_gains``)."""
        cur = self.current

        def rank(p: Prediction) -> tuple[Any, ...]:
            return (
                *p.meet_key(),
                *p.ready_key(),
                -(p.itl_max_ms if p.itl_max_ms is not None else math.inf),
                -p.setting.distance(cur),
            )

        best = max(preds, key=rank)
        # a tie in requests meeting the SLOs goes to the setting that keeps more of them clear
        # of a stall past the ITL SLO, by the same margin
        gains = self._gains(best, here, n)
        readying = False
        if not gains[3] and here.ready_key() != (0, 0):
            # the current setting is not ready for a long prompt, or for several at once: the
            # readiest setting that loses nothing on either count against it (the gains above
            # were too small to move)
            ready = [
                p
                for p in preds
                if p.ready_key() > here.ready_key()
                and p.num_meet >= here.num_meet
                and p.meet_key()[1] >= here.meet_key()[1]
            ]
            if ready:
                best = max(ready, key=rank)
                margin, gain, gain_tail, _ = self._gains(best, here, n)
                gains = (margin, gain, gain_tail, True)
                readying = True
        return best, readying, gains

    def _change_why(
        self,
        fit: FitReport,
        best: Prediction,
        here: Prediction,
        n: int,
        probe: int,
        *,
        readying: bool,
        gains: tuple[int, int, int, bool],
    ) -> str:
        """What a move to ``best`` gains, for its reason: readiness for one long prompt or for
        several, more requests meeting the SLOs, or more keeping every token gap within it."""
        cur = self.current
        margin, gain, gain_tail, _ = gains
        if readying and (best.readiness or 0) > (here.readiness or 0):
            return (
                f" (at least as many of {n} requests meet {self.slo.text()}; a prompt of "
                f"{probe} tokens arriving now would stall streams "
                f"{best.probe_stall_ms:.0f} ms here, {here.probe_stall_ms:.0f} ms at "
                f"{cur.label()}{_extrapolation_note(fit, best, here)})"
            )
        if readying:
            return (
                f" (at least as many of {n} requests meet {self.slo.text()}; prompts of "
                f"{probe} tokens arriving together would stall streams "
                f"{best.burst_stall_ms:.0f} ms here, {here.burst_stall_ms:.0f} ms at "
                f"{cur.label()}, whose cap bounds each prompt's chunk but not their sum"
                f"{_extrapolation_note(fit, best, here)})"
            )
        if gain >= margin:
            return f" ({gain} more of {n} requests meet {self.slo.text()})"
        return (
            f" (as many of {n} requests meet {self.slo.text()}; {gain_tail} more keep "
            f"every token gap within {self.slo.itl_ms:g} ms)"
        )

    def _hold_why(
        self,
        best: Prediction,
        gains: tuple[int, int, int, bool],
        *,
        dwell: bool,
        confirm: int,
    ) -> str:
        """Why a hold does not move to ``best``: it is the current setting, gains too little,
        waits out the dwell, or has not yet won enough ticks in a row."""
        cfg, cur = self.config, self.current
        margin, gain, _, enough = gains
        if best.setting == cur or not enough:
            return (
                "it is the best predicted"
                if best.setting == cur
                else (f"{best.setting.label()} gains {gain} (< {margin}) requests")
            )
        if not dwell:
            return f"{best.setting.label()} waits out the {cfg.min_dwell_s:g} s dwell"
        return (
            f"{best.setting.label()} needs {confirm} ticks in a row of the current setting beaten"
        )
