"""vLLM's scheduling, told as chunkscope's wire events (schema 1). Imports neither vllm nor torch.

``chunkscope.integrations.vllm`` (the only module that imports vllm) reads plain facts off vLLM's
scheduler at three points of its core thread and hands them to a :class:`StepTranslator`:

- a request added (``arrived``, with vLLM's frontend wall-clock ``arrival_time``), a request
  aborted from outside (``aborted``);
- ``schedule()`` returned: the step's chunks in scheduling order as :class:`ScheduledChunk`
  (``num_computed_tokens`` read before vLLM advanced it), preempted requests, queue lengths and
  KV blocks; the step takes the next index only when it scheduled tokens, so the indices of the
  steps that ran have no gaps;
- ``update_from_output()`` began (the model output is back: every token of the step has this
  time): which requests produced how many tokens, which finished and why.

Events go out in the contract's causal order: what happened before a step (arrivals, aborts,
controls that apply at it, preemptions, ``first_scheduled``), the ``step``, then what the step
finished (``first_token``, ``finished``); an abort or a control that lands while a step is
executing is held until that step's events are out, and goes out at once otherwise. Request
ids are the ids the OpenAI client sees (:func:`external_request_id`). :class:`BudgetControl`
is the live budget: checked by the rule ``PUT /v1/scheduler`` uses, answered at once with the
step it applies at, applied by the scheduler thread at the top of the next ``schedule()``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.server.protocol import TRAFFIC_CLASS_MAX_LEN
from wire.control import CAP_KEY, check_changes
from wire.events import ChunkRecord, ClockAnchor, ControlEvent, RequestEvent, StepEvent

Publish = Callable[[Any], None]

# vLLM (v1 InputProcessor.assign_request_id) makes the engine's id unique by appending
# "-" + 8 characters of a random uuid's hex to the frontend's id.
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
# The completions endpoint gives prompt i of a request the id f"{response id}-{i}".
_COMPLETION_INDEX = re.compile(r"^(cmpl-.+)-(\d+)$")

# vllm.v1.engine.FinishReason values, by their integer (they are an IntEnum).
FINISH_REASONS = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "repetition"}


def external_request_id(internal_id: str, *, randomized: bool = True) -> str:
    """The id the OpenAI client sees for vLLM's internal request id.

    ``randomized``: vLLM appended its 8-character suffix (the default; off only with
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``). A completion's first prompt (``cmpl-X-0``) is
    the response id ``cmpl-X``; prompt ``i > 0`` of a batched completion keeps ``-i`` so that
    ids stay unique. Chat completion ids (``chatcmpl-X``) and ids from an ``X-Request-Id``
    header are kept as sent.
    """
    ext = _RANDOM_SUFFIX.sub("", internal_id) if randomized else internal_id
    m = _COMPLETION_INDEX.match(ext)
    if m is not None and m.group(2) == "0":
        return m.group(1)
    return ext


def finish_reason_name(reason: Any) -> str | None:
    """``stop`` / ``length`` / ``abort`` / ... for a vLLM ``FinishReason`` (or its int)."""
    if reason is None:
        return None
    try:
        return FINISH_REASONS.get(int(reason), str(reason))
    except (TypeError, ValueError):
        return str(reason)


def traffic_class_of(extra_args: Mapping[str, Any] | None) -> str | None:
    """The traffic class a client put in vLLM's ``vllm_xargs`` (``{"traffic_class": "chat"}``,
    which vLLM hands to the scheduler as ``SamplingParams.extra_args``; loadgen sends it), by
    the rule of chunkscope's ``X-Traffic-Class`` header; None when absent or not such a label
    (vLLM has accepted the request by then: it is stored without a class, not refused)."""
    if not isinstance(extra_args, Mapping):
        return None
    value = extra_args.get("traffic_class")
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > TRAFFIC_CLASS_MAX_LEN:
        return None
    if not all(c.isalnum() or c in "-_.:" for c in value):
        return None
    return value.lower()


def chunk_kind(start: int, num_tokens: int, num_prompt_tokens: int, num_tokens_total: int) -> str:
    """``decode`` for a chunk of one token past the prompt that reaches the request's end (it
    feeds back the last sampled token); ``prefill`` otherwise, recomputation after a
    preemption included."""
    if num_tokens == 1 and start >= num_prompt_tokens and start + 1 >= num_tokens_total:
        return "decode"
    return "prefill"


class ScheduledChunk(NamedTuple):
    """One request's share of a step, as vLLM scheduled it. A plain tuple in this field order
    does as well (the bridge passes tuples: a step of 64 chunks builds no objects for them)."""

    request_id: str  # vLLM's internal id
    start: int  # num_computed_tokens before this step
    num_tokens: int
    num_prompt_tokens: int
    num_tokens_total: int  # prompt + output tokens known when the step was scheduled


@dataclass
class _Req:
    external_id: str
    num_prompt_tokens: int
    scheduled: bool = False
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class _InFlight:
    """The step vLLM is executing: its fields as read at ``schedule()`` (the event is built once
    its output is back) and its chunks as ``(internal id, external id, kind, start, tokens)``."""

    fields: dict[str, Any]
    chunks: list[tuple[str, str, str, int, int]]
    held: list[Any] = field(default_factory=list)  # aborts that landed during the step


class StepTranslator:
    """Turns what the vLLM bridge reads into published events (see the module docstring).

    Every method is called on vLLM's engine-core thread, except that controls may be queued
    from the publisher's thread (:meth:`queue_control`, under ``lock``).
    """

    def __init__(
        self,
        publish: Publish,
        anchor: ClockAnchor,
        *,
        policy: str = "chunked",
        randomized_ids: bool = True,
    ) -> None:
        self._publish = publish
        self.anchor = anchor
        self.policy = policy
        self.randomized_ids = randomized_ids
        self.lock = threading.Lock()
        self.last_step = 0  # index of the latest step that scheduled tokens
        self._reqs: dict[str, _Req] = {}
        self._inflight: _InFlight | None = None

    # --- requests --------------------------------------------------------------------------
    def arrived(
        self,
        request_id: str,
        arrival_wall_s: float | None,
        num_prompt_tokens: int,
        traffic_class: str | None = None,
    ) -> None:
        if request_id in self._reqs:
            return
        ext = external_request_id(request_id, randomized=self.randomized_ids)
        self._reqs[request_id] = _Req(ext, int(num_prompt_tokens))
        now = time.monotonic_ns()
        t = now if arrival_wall_s is None else min(now, self.anchor.to_mono_ns(arrival_wall_s))
        self._emit(
            RequestEvent(
                "arrived",
                ext,
                t,
                num_prompt_tokens=int(num_prompt_tokens),
                traffic_class=traffic_class,
            )
        )

    def aborted(self, request_ids: list[str], reason: str = "abort") -> None:
        """Requests finished from outside the scheduler (client gone, stop string matched by
        the frontend): their ``aborted`` event, held until a step executing now is told."""
        now = time.monotonic_ns()
        for rid in request_ids:
            req = self._reqs.pop(rid, None)
            if req is None:
                continue
            ev = RequestEvent(
                "aborted",
                req.external_id,
                now,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens,
                finish_reason=reason,
            )
            if self._inflight is not None:
                self._inflight.held.append(ev)
            else:
                self._emit(ev)

    def knows(self, request_id: str) -> bool:
        return request_id in self._reqs

    # --- controls ---------------------------------------------------------------------------
    def queue_control(self, event: ControlEvent) -> None:
        """A control event (call under lock), published in its place in the stream: at once
        when no step is in flight, else right after the in-flight step's event; either way
        before the step it applies at. Never held until a next step: an idle vLLM may run none
        for hours, or be stopped first, and the acknowledged change would not reach the store
        (the native engine's rule too)."""
        if self._inflight is not None:
            self._inflight.held.append(event)
        else:
            self._emit(event)

    @property
    def next_step(self) -> int:
        return self.last_step + 1

    # --- steps ------------------------------------------------------------------------------
    def scheduled(
        self,
        *,
        start_ns: int,
        token_budget: int,
        chunks: Sequence[ScheduledChunk | tuple[str, int, int, int, int]],
        long_prefill_token_threshold: int = 0,
        preempted: list[str],
        num_running: int,
        num_waiting: int,
        kv_blocks_used: int,
        kv_blocks_total: int,
    ) -> int | None:
        """``schedule()`` returned. Returns the step's index, or None when it scheduled no
        tokens (no step then: nothing runs)."""
        for rid in preempted:
            req = self._reqs.get(rid)
            if req is not None:
                self._emit(
                    RequestEvent(
                        "preempted",
                        req.external_id,
                        start_ns,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_output_tokens=req.num_output_tokens,
                        step=self.next_step if chunks else None,
                    )
                )
        if not chunks:
            return None
        self.last_step += 1
        step = self.last_step
        reqs = self._reqs
        rows: list[tuple[str, str, str, int, int]] = []
        add = rows.append
        num_decode = num_prefill = 0
        for rid, start, n, n_prompt, n_total in chunks:
            req = reqs.get(rid)
            if req is None:  # added before the bridge was up: known from here on
                req = _Req(external_request_id(rid, randomized=self.randomized_ids), n_prompt)
                reqs[rid] = req
            if not req.scheduled:
                req.scheduled = True
                req.num_cached_tokens = start
                self._emit(
                    RequestEvent(
                        "first_scheduled",
                        req.external_id,
                        start_ns,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_cached_tokens=start,
                        step=step,
                    )
                )
            kind = chunk_kind(start, n, n_prompt, n_total)
            if kind == "decode":
                num_decode += n
            else:
                num_prefill += n
            add((rid, req.external_id, kind, start, n))
        self._inflight = _InFlight(
            {
                "step": step,
                "start_ns": start_ns,
                "token_budget": int(token_budget),
                "policy": self.policy,
                "long_prefill_token_threshold": int(long_prefill_token_threshold),
                "num_decode_tokens": num_decode,
                "num_prefill_tokens": num_prefill,
                "num_scheduled_tokens": num_decode + num_prefill,
                "num_running": int(num_running),
                "num_waiting": int(num_waiting),
                "kv_blocks_used": int(kv_blocks_used),
                "kv_blocks_total": int(kv_blocks_total),
                "num_preemptions": len(preempted),
            },
            rows,
        )
        return step

    def executed(
        self,
        *,
        end_ns: int,
        produced: Mapping[str, int],
        finished: Mapping[str, Any],
        forward_start_ns: int | None = None,
        num_running: int | None = None,
        num_waiting: int | None = None,
    ) -> None:
        """The model output of the step in flight is back (``end_ns``): ``produced`` maps
        vLLM's request ids to the number of tokens each got, ``finished`` to a finish reason
        (a ``FinishReason`` or its name). ``num_running`` / ``num_waiting``: vLLM's queues once
        the step's finished requests left them, what the native engine's step reports (a
        reader tells "busy after this step" from them); None keeps the counts at schedule."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        fields = flight.fields
        index = fields["step"]
        if num_running is not None:
            fields["num_running"] = int(num_running)
        if num_waiting is not None:
            fields["num_waiting"] = int(num_waiting)
        reqs = self._reqs
        got = produced.get
        records: list[ChunkRecord] = []
        add = records.append
        after: list[RequestEvent] = []
        for rid, ext, kind, start, n in flight.chunks:
            k = got(rid, 0)
            req = reqs.get(rid) if k > 0 else None
            if req is None:  # no token, or the request was aborted during the step
                add(ChunkRecord(ext, kind, start, n, False))
                continue
            add(ChunkRecord(ext, kind, start, n, True))
            if req.num_output_tokens == 0:
                after.append(
                    RequestEvent(
                        "first_token",
                        ext,
                        end_ns,
                        num_prompt_tokens=req.num_prompt_tokens,
                        num_output_tokens=1,
                        num_cached_tokens=req.num_cached_tokens,
                        step=index,
                    )
                )
            req.num_output_tokens += int(k)
        for rid, reason in finished.items():
            req = reqs.pop(rid, None)
            if req is None:
                continue
            after.append(
                RequestEvent(
                    "finished",
                    req.external_id,
                    end_ns,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_output_tokens=req.num_output_tokens,
                    num_cached_tokens=req.num_cached_tokens,
                    finish_reason=finish_reason_name(reason),
                    step=index,
                )
            )
        self._emit(
            StepEvent(
                end_ns=end_ns,
                forward_ns=max(0, end_ns - forward_start_ns) if forward_start_ns else 0,
                chunks=records,
                **fields,
            )
        )
        for ev in after:
            self._emit(ev)
        for ev in flight.held:
            self._emit(ev)

    def _emit(self, event: Any) -> None:
        self._publish(event)


class BudgetControl:
    """vLLM's live controls: the token budget (``max_num_scheduled_tokens``) and the long-prefill
    cap (``scheduler_config.long_prefill_token_threshold``), both read by vLLM's ``schedule()``
    once per step. ``request`` (any thread) checks a relayed change by the wire's rule (from 1,
    the cap from 0, to the budget vLLM started with) and answers at once with the step it
    applies at; ``take`` (the scheduler thread, top of ``schedule()``) returns the values to
    write. Both run under the translator's lock, which the bridge also holds while vLLM
    schedules, so the answered step is exact."""

    def __init__(
        self,
        translator: StepTranslator,
        max_token_budget: int,
        policies: tuple[str, ...],
        long_prefill_token_threshold: int = 0,
    ):
        self.translator = translator
        self.max_token_budget = int(max_token_budget)
        self.policies = policies
        self.budget = self.max_token_budget  # what is (or will be, from next_step) in force
        self.cap = int(long_prefill_token_threshold)
        self._pending: dict[str, int] = {}

    def request(
        self, changes: Mapping[str, object], *, source: str, request_id: str | None
    ) -> dict[str, Any]:
        """Apply ``changes`` from the next step; ``{"applied_at_step", "old", "new"}``, or
        ``ControlRefused`` (nothing changed) for a bad key or value."""
        checked = check_changes(changes, self.max_token_budget, self.policies)
        now = time.monotonic_ns()
        old: dict[str, object] = {}
        new: dict[str, object] = {}
        with self.translator.lock:
            step = self.translator.next_step
            for key, value in checked.items():
                before: object
                if key == "token_budget":
                    before, self.budget = self.budget, int(value)  # type: ignore[call-overload]
                    self._pending[key] = self.budget
                elif key == CAP_KEY:
                    before, self.cap = self.cap, int(value)  # type: ignore[call-overload]
                    self._pending[key] = self.cap
                else:  # the policy vLLM runs (the only one it has): nothing to write
                    before = self.translator.policy
                old[key], new[key] = before, value
                self.translator.queue_control(
                    ControlEvent(
                        key=key,
                        old_value=before,
                        new_value=value,
                        accepted=True,
                        time_ns=now,
                        source=source,
                        applied_at_step=step,
                        request_id=request_id,
                    )
                )
        return {"applied_at_step": step, "old": old, "new": new}

    def take(self) -> dict[str, int]:
        """The values to write before this step schedules (call under the lock): ``token_budget``
        and/or ``long_prefill_token_threshold``; empty when nothing changed."""
        pending, self._pending = self._pending, {}
        return pending


class BridgeTiming:
    """The bridge's own cost on vLLM's busy loop: nanoseconds its hooks spent on the core thread
    per step, against the step's wall time (schedule() entry to update_from_output() exit), and
    the publisher thread's CPU time over the same steps. ``add`` returns a summary line every
    ``every`` steps (then starts afresh), else None."""

    def __init__(self, every: int, publisher_cpu_ns: Any = None) -> None:
        self.every = max(1, int(every))
        self._cpu = publisher_cpu_ns  # () -> int or None
        self._bridge: list[int] = []
        self._wall = 0
        self._cpu0 = self._read_cpu()

    def _read_cpu(self) -> int | None:
        try:
            return int(self._cpu()) if self._cpu is not None else None
        except Exception:  # noqa: BLE001 - the thread may be gone
            return None

    def add(self, bridge_ns: int, step_wall_ns: int) -> str | None:
        self._bridge.append(bridge_ns)
        self._wall += max(0, step_wall_ns)
        if len(self._bridge) < self.every:
            return None
        return self.summary()

    def summary(self) -> str | None:
        n = len(self._bridge)
        if not n:
            return None
        xs = sorted(self._bridge)
        total = sum(xs)
        cpu = self._read_cpu()
        pub = (cpu - self._cpu0) if cpu is not None and self._cpu0 is not None else None
        line = (
            f"chunkscope: bridge time on the core thread over {n} steps: mean "
            f"{total / n / 1e3:.1f} us, p50 {xs[n // 2] / 1e3:.1f} us, p99 "
            f"{xs[min(n - 1, (99 * n) // 100)] / 1e3:.1f} us per step, "
            f"{100 * total / self._wall if self._wall else 0.0:.3f}% of step wall time"
            + (
                f"; publisher thread CPU {pub / n / 1e3:.1f} us per step "
                f"({100 * pub / self._wall if self._wall else 0.0:.3f}%)"
                if pub is not None
                else ""
            )
        )
        self._bridge, self._wall, self._cpu0 = [], 0, cpu
        return line


_DP_PROCESS = re.compile(r"EngineCore_DP(\d+)")


def dp_identity(
    size: int | None, rank: int | None, index: int | None, process_name: str
) -> tuple[bool, int, int | None]:
    """(data parallel?, this core's rank, DP size or None when unknown) from vLLM's parallel
    config as the engine core sees it. vLLM 0.32 runs the ranks of a dense (non-MoE) model as
    independent engines: it resets ``data_parallel_size`` to 1 and ``data_parallel_rank`` to 0 in
    each core (``reconfigure_for_independent_dp_rank``) and keeps the rank in
    ``data_parallel_index``; the launcher names the process ``EngineCore_DP<rank>``."""
    size = int(size or 1)
    m = _DP_PROCESS.fullmatch(process_name or "")
    r = int(index if index is not None else (rank or 0))
    if m is not None and r == 0:
        r = int(m.group(1))
    dp = size > 1 or r > 0 or m is not None
    return dp, r, (size if size > 1 else None) if dp else 1
