"""Token-budget scheduler: one step = one token budget. No torch.

Each step, in this order:

1. one token for every running decode, oldest first (if the budget is smaller than the number
   of decodes, the youngest wait a step);
2. chunks for running partial prefills, oldest first;
3. chunks for waiting requests in arrival order (preempted requests keep their arrival place),
   each taking ``min(tokens left in its prompt, budget left)``.

With ``long_prefill_token_threshold`` (vLLM's name; 0 = off) each prefill chunk of steps 2 and 3
takes at most that many tokens, so the prompts behind a long one get a share of the budget in
the same step; then, work-conserving, the budget that no other prompt took goes back to the
capped chunks, the fewest tokens left first (a long prompt alone still prefills at the full
budget). A chunk the cap kept smaller than it would otherwise have been is marked ``capped``.

Under the ``unchunked`` policy a prompt is never split: it is scheduled whole when it fits in
what is left of the budget, and the first prompt of a step is scheduled whole even when it does
not (so none waits forever) - which is exactly what makes long prompts stall decodes.

An image token costs the budget ``image_token_cost`` tokens (default 1; the engine sets it to
one plus the vision encoder's work per image token over the language model's per token), so a
chunk holding image tokens is shorter and an image step costs what a text step of the same
budget costs. The plan's token counts stay tokens; only what a chunk takes from the budget is
weighted.

When the KV cache runs out, the most recently arrived running request that has no chunk in this
step yet is preempted (its blocks freed, to be recomputed later). The budget and policy are read
once at the start of each step; ``set_token_budget`` / ``set_policy`` /
``set_long_prefill_token_threshold`` may be called from any thread and take effect at the next
step that schedules tokens.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from dataclasses import dataclass, field

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from wire.control import refusal

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """``num_tokens`` positions of ``request`` starting at ``start``."""

    request: Request
    kind: str  # "prefill" | "decode"
    start: int
    num_tokens: int
    # True when the long-prefill cap kept this chunk smaller than it would have been without it.
    capped: bool = False
    # True when the chunk reaches the last known token, whose logits give the next token.
    produces_token: bool = field(init=False)

    def __post_init__(self) -> None:
        self.produces_token = self.start + self.num_tokens == self.request.num_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class StepPlan:
    step: int
    token_budget: int
    policy: str
    long_prefill_token_threshold: int = 0
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_decode_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.kind == "decode")

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.kind == "prefill")

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class ControlResult:
    key: str
    accepted: bool
    old_value: object
    new_value: object
    applied_at_step: int | None
    reason: str | None = None


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        token_budget: int,
        max_token_budget: int,
        policy: str = "chunked",
        max_num_seqs: int = 256,
        max_model_len: int = 1 << 30,
        long_prefill_token_threshold: int = 0,
        image_token_cost: float = 1.0,
    ) -> None:
        if not 1.0 <= image_token_cost <= 64.0:
            raise ValueError(f"image_token_cost must lie in [1, 64], got {image_token_cost}")
        self.image_token_cost = image_token_cost
        self.block_manager = block_manager
        self.max_token_budget = max_token_budget
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # arrival order
        self.running: list[Request] = []  # arrival order
        self._lock = threading.Lock()
        self._next_step = 0
        self._token_budget = token_budget
        self._policy = policy
        self._long_prefill = 0
        for result in (
            self.set_token_budget(token_budget),
            self.set_policy(policy),
            self.set_long_prefill_token_threshold(long_prefill_token_threshold),
        ):
            if not result.accepted:
                raise ValueError(result.reason)

    # --- live control (any thread) ------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def policy(self) -> str:
        return self._policy

    @property
    def long_prefill_token_threshold(self) -> int:
        return self._long_prefill

    @property
    def next_step(self) -> int:
        return self._next_step

    def set_token_budget(self, value: object) -> ControlResult:
        with self._lock:
            old = self._token_budget
            reason = refusal("token_budget", value, max_token_budget=self.max_token_budget)
            if reason is None:
                self._token_budget = value  # type: ignore[assignment]
                return ControlResult("token_budget", True, old, value, self._next_step)
        return ControlResult("token_budget", False, old, value, None, reason)

    def set_long_prefill_token_threshold(self, value: object) -> ControlResult:
        """The most prefill tokens one request may take in a step while other prompts wait for
        budget (0 = no cap); checked like the budget: an integer from 0 to the budget's maximum."""
        key = "long_prefill_token_threshold"
        with self._lock:
            old = self._long_prefill
            if isinstance(value, bool) or not isinstance(value, int):
                reason = f"{key} must be an int, got {value!r}"
            elif not 0 <= value <= self.max_token_budget:
                reason = f"{key} must be from 0 to {self.max_token_budget}, got {value}"
            else:
                self._long_prefill = value
                return ControlResult(key, True, old, value, self._next_step)
        return ControlResult(key, False, old, value, None, reason)

    def set_policy(self, value: object) -> ControlResult:
        with self._lock:
            old = self._policy
            reason = refusal("policy", value, max_token_budget=self.max_token_budget)
            if reason is None:
                self._policy = str(value)
                return ControlResult("policy", True, old, value, self._next_step)
        return ControlResult("policy", False, old, value, None, reason)

    # --- requests -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=lambda r: r.arrival_index)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    self._finish(req, RequestStatus.FINISHED_ABORTED)
                    return req
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = status

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        bisect.insort(self.waiting, req, key=lambda r: r.arrival_index)

    # --- the step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step's plan. Holds the control lock throughout, so a budget or policy
        change lands either before this plan (in force now) or after it (``applied_at_step`` is
        the next index). A plan without chunks takes no step index: the indices of the steps that
        run are consecutive, and ``applied_at_step`` names a step that runs."""
        with self._lock:
            plan = StepPlan(self._next_step, self._token_budget, self._policy, self._long_prefill)
            self._fill(plan)
            if plan.chunks:
                self._next_step += 1
        return plan

    def _fill(self, plan: StepPlan) -> None:
        left = plan.token_budget
        scheduled: set[str] = set()
        chunked = plan.policy == "chunked"
        prefill_scheduled = False
        cap = plan.long_prefill_token_threshold if chunked else 0
        capped: dict[int, int] = {}  # index in plan.chunks -> its size without the cap

        # 1. one token for each running decode, oldest first.
        for req in list(self.running):
            if left == 0:
                break
            if req.status != RequestStatus.RUNNING or req.is_prefill:
                continue
            if self._reserve(req, 1, scheduled, plan) == 1:
                plan.chunks.append(ScheduledChunk(req, "decode", req.num_computed_tokens, 1))
                scheduled.add(req.request_id)
                left -= 1

        # 2. running partial prefills, oldest first.
        for req in list(self.running):
            if left <= 0:
                break
            if req.status != RequestStatus.RUNNING or req.request_id in scheduled:
                continue
            start = req.num_computed_tokens
            if chunked:
                full = self._fit(req, start, req.num_remaining, left)
                n = self._reserve(req, min(full, cap or full), scheduled, plan, shrink=True)
                if 0 < n == cap < full:
                    capped[len(plan.chunks)] = full
            elif req.num_remaining <= left or not prefill_scheduled:
                n = self._reserve(req, req.num_remaining, scheduled, plan)
            else:
                n = 0
            if n > 0:
                plan.chunks.append(ScheduledChunk(req, "prefill", start, n))
                scheduled.add(req.request_id)
                prefill_scheduled = True
                left -= self._cost(req, start, n)

        # 3. waiting requests in arrival order.
        bm = self.block_manager
        while self.waiting and left > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = bm.find_cached_prefix(req)
            todo = req.num_tokens - len(hits) * bm.block_size
            start = len(hits) * bm.block_size
            full = 0
            if chunked:
                n = self._fit(req, start, todo, left)
                if 0 < cap < n:
                    n, full = cap, n
                if not bm.can_allocate(req, n, hits):
                    n = min(n, self._tokens_that_fit(req, hits))
            elif todo <= left or not prefill_scheduled:
                n = todo if bm.can_allocate(req, todo, hits) else 0
            else:
                n = 0
            if n <= 0:
                break  # first come, first served: the head waits for memory or budget
            bm.allocate(req, n, hits)
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * bm.block_size
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_index)
            if full and n == cap:
                capped[len(plan.chunks)] = full
            plan.chunks.append(ScheduledChunk(req, "prefill", req.num_computed_tokens, n))
            scheduled.add(req.request_id)
            prefill_scheduled = True
            left -= self._cost(req, req.num_computed_tokens, n)

        # 4. work-conserving: what no other prompt took goes back to the capped chunks, the
        # fewest tokens left first (a short prompt finishes its prefill, and so gets its first
        # token, before a long one takes the rest), then in arrival order.
        def tokens_left(i: int) -> tuple[int, int]:
            c = plan.chunks[i]
            return c.request.num_tokens - c.start - c.num_tokens, c.request.arrival_index

        for i in sorted(capped, key=tokens_left):
            if left > 0:
                c = plan.chunks[i]
                before = self._cost(c.request, c.start, c.num_tokens)
                self._extend(plan, i, left)
                c = plan.chunks[i]
                left -= self._cost(c.request, c.start, c.num_tokens) - before
            plan.chunks[i].capped = plan.chunks[i].num_tokens < capped[i]
        self._check_plan(plan)

    def _extend(self, plan: StepPlan, i: int, left: int) -> None:
        """Grow the capped chunk ``plan.chunks[i]`` by up to ``left`` tokens, as far as its prompt
        and the free KV blocks allow (no preemption for the extra)."""
        c = plan.chunks[i]
        req = c.request
        n = self._fit(
            req, c.start, req.num_tokens - c.start, self._cost(req, c.start, c.num_tokens) + left
        )
        if not self.block_manager.can_allocate(req, n):
            n = max(c.num_tokens, min(n, self._tokens_that_fit(req, [])))
        if n > c.num_tokens:
            self.block_manager.allocate(req, n)
            plan.chunks[i] = ScheduledChunk(req, "prefill", c.start, n)

    def _cost(self, req: Request, start: int, n: int) -> int:
        """What tokens ``[start, start + n)`` of ``req`` take from the budget: one per token,
        ``image_token_cost`` per image token (rounded up)."""
        if self.image_token_cost == 1.0 or not req.image_spans:
            return n
        end = start + n
        images = sum(max(0, min(end, s + k) - max(start, s)) for s, k in req.image_spans)
        return n + math.ceil(images * (self.image_token_cost - 1.0) - 1e-9)

    def _fit(self, req: Request, start: int, most: int, left: int) -> int:
        """The most tokens from ``start`` (at most ``most``) whose cost fits in ``left``, and
        never none while any budget is left (an image token costing more than a tiny budget
        still goes, one a step, so no prompt waits forever)."""
        if self._cost(req, start, min(most, left)) <= left:
            return max(0, min(most, left))
        lo, hi = 0, min(most, left)  # cost(lo) fits, cost(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._cost(req, start, mid) <= left:
                lo = mid
            else:
                hi = mid
        return lo or (1 if left >= 1 and most >= 1 else 0)

    def _tokens_that_fit(self, req: Request, hits: list[int]) -> int:
        bm = self.block_manager
        revived = sum(1 for b in hits if bm.ref_counts[b] == 0)
        blocks = len(req.block_ids) + len(hits) + bm.num_free_blocks - revived
        return blocks * bm.block_size - req.num_computed_tokens - len(hits) * bm.block_size

    def _reserve(
        self, req: Request, n: int, scheduled: set[str], plan: StepPlan, shrink: bool = False
    ) -> int:
        """Make room for ``n`` more tokens of a running request, preempting the most recently
        arrived running requests not yet in this step. Returns the tokens reserved (0 if none;
        fewer than ``n`` only when ``shrink``). May preempt ``req`` itself as a last resort."""
        bm = self.block_manager
        while not bm.can_allocate(req, n):
            candidates = [r for r in self.running if r.request_id not in scheduled]
            victim = max(candidates, key=lambda r: r.arrival_index)
            if victim is req:
                fit = self._tokens_that_fit(req, [])
                if shrink and fit > 0:
                    n = fit
                    break
                self._preempt(req)
                plan.preempted.append(req)
                return 0
            self._preempt(victim)
            plan.preempted.append(victim)
        bm.allocate(req, n)
        return n

    def _check_plan(self, plan: StepPlan) -> None:
        ids = [c.request_id for c in plan.chunks]
        assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
        total = plan.num_scheduled_tokens
        if plan.policy == "chunked":
            assert total <= plan.token_budget, f"budget exceeded: {total} > {plan.token_budget}"
        else:
            over = [c for c in plan.chunks if c.kind == "prefill"]
            assert total <= plan.token_budget or len(over) == 1, "unchunked step over budget"
        assert len(self.running) <= self.max_num_seqs

    # --- after the model ran ------------------------------------------------------------------
    def update(
        self,
        plan: StepPlan,
        sampled: dict[str, int],
        now_ns: int,
        failed: dict[str, str] | None = None,
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens (stamped ``now_ns``, monotonic
        nanoseconds), finish requests. Returns the requests that produced a token this step
        (finished ones included).

        With ``failed`` given, a request whose stop check raises is left running and not
        returned, and ``failed[request_id]`` says why: the caller fails that request alone.
        Without it, the exception propagates."""
        produced: list[Request] = []
        for chunk in plan.chunks:
            req = chunk.request
            if req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(req)
            if not chunk.produces_token:
                continue
            req.append_token(sampled[req.request_id], now_ns)
            try:
                stop = req.check_stop()
            except Exception as exc:
                if failed is None:
                    raise
                failed[req.request_id] = f"stop check failed: {type(exc).__name__}: {exc}"
                continue
            produced.append(req)
            if stop is None and req.num_tokens >= self.max_model_len:
                stop = RequestStatus.FINISHED_LENGTH
            if stop is not None:
                self._finish(req, stop)
        return produced
