"""The engine: add requests from any thread, step on one thread (schedule, run, update, emit)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from engine.admission import QueueFullError, RequestLimits, check_queue, check_request
from engine.attention import select_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.events import ChunkRecord, ControlEvent, Event, RequestEvent, StepEvent
from engine.model.loader import load_model, resolve_model
from engine.outputs import EngineStats, RequestOutput
from engine.request import ImageInput, Request, RequestStatus
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ControlResult, Scheduler, StepPlan

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 2 << 30  # default KV cache on CPU: 2 GiB (or what fits max_model_len x 4)


@dataclass
class StepResult:
    event: StepEvent | None
    outputs: list[RequestOutput] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        self.engine_id = config.engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        source = resolve_model(config.model)
        arch = source.arch
        self.max_model_len = config.max_model_len or min(arch.max_position_embeddings, 32768)
        loaded = load_model(
            source,
            device=self.device,
            dtype=self.dtype,
            max_positions=self.max_model_len,
            seed=config.seed,
        )
        self.model_name = loaded.name
        self.arch = arch
        self.tokenizer = loaded.tokenizer
        self.vision = self._build_vision(arch.hidden_size, config.seed)
        bs = config.block_size
        num_blocks = config.num_kv_blocks or self._default_num_blocks(bs)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            token_budget=config.token_budget,
            max_token_budget=config.max_token_budget,
            policy=config.policy,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        backend = select_backend(config.attention_backend, self.device, bs)
        self.runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=bs,
            device=self.device,
            dtype=self.dtype,
            backend=backend,
            seed=config.seed,
            vision=self.vision,
        )
        logger.info(
            "engine %s: model %s (%.1fM params) on %s/%s, attention %s, %d KV blocks of %d, "
            "max_model_len %d",
            self.engine_id,
            self.model_name,
            arch.num_params / 1e6,
            self.device,
            self.dtype,
            backend.name,
            num_blocks,
            bs,
            self.max_model_len,
        )
        self._inbox: deque[tuple[str, object]] = deque()
        self._cond = threading.Condition()
        self._requests: dict[str, Request] = {}
        self._num_unfinished = 0
        self._listeners: list[Callable[[Event], None]] = []
        self._stats = EngineStats(0, 0, 0, num_blocks, 0, config.token_budget, config.policy)
        self.limits = RequestLimits(
            model_name=self.model_name,
            vocab_size=arch.vocab_size,
            max_model_len=self.max_model_len,
            num_kv_blocks=num_blocks,
            block_size=bs,
            accepts_images=self.vision is not None,
            image_token_id=self.tokenizer.image_token_id,
            max_waiting=config.max_waiting,
        )

    # --- construction helpers -----------------------------------------------------------------
    def _build_vision(self, hidden: int, seed: int) -> torch.nn.Module | None:
        if self.tokenizer.image_token_id is None:
            return None
        try:
            from engine.model.vision import VisionEncoder
        except ImportError:
            logger.warning("no vision encoder available: image inputs are refused")
            return None
        with torch.device(self.device):
            enc = VisionEncoder(hidden, seed=seed)
        return enc.to(self.dtype).eval()

    def _default_num_blocks(self, block_size: int) -> int:
        per_token = self.arch.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        if self.device.type == "cuda":
            fraction = self.config.kv_memory_fraction or 0.9
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * fraction) - (total - free)
        else:
            budget = (
                self.config.kv_memory_fraction
                and int(self.config.kv_memory_fraction * _total_memory())
                or min(CPU_KV_CACHE_BYTES, max(4 * self.max_model_len, 65536) * per_token)
            )
        blocks = budget // (per_token * block_size)
        if blocks < -(-self.max_model_len // block_size):
            raise ValueError(
                f"the KV cache ({blocks} blocks of {block_size}) cannot hold one request of "
                f"max_model_len={self.max_model_len}: lower max_model_len or give more memory"
            )
        return int(blocks)

    # --- thread-safe API ----------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    @property
    def policy(self) -> str:
        return self.scheduler.policy

    @property
    def max_token_budget(self) -> int:
        return self.scheduler.max_token_budget

    def add_listener(self, fn: Callable[[Event], None]) -> None:
        self._listeners.append(fn)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        traffic_class: str | None = None,
        images: list[ImageInput] | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; the step loop picks it up at its next step."""
        prompt = check_request(prompt_token_ids, params, images, self.limits)
        image_id = self.tokenizer.image_token_id
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        req = Request(
            request_id,
            prompt,
            params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            traffic_class=traffic_class,
            images=images,
            image_token_id=image_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        with self._cond:
            waiting = self._stats.num_waiting + sum(1 for k, _ in self._inbox if k == "add")
            check_queue(waiting, self.limits)
            self._inbox.append(("add", req))
            self._num_unfinished += 1
            self._cond.notify_all()
        return request_id

    def abort_request(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify_all()

    def has_unfinished_requests(self) -> bool:
        with self._cond:
            return self._num_unfinished > 0 or bool(self._inbox)

    def wait_for_work(self, timeout: float) -> bool:
        with self._cond:
            if self._num_unfinished > 0 or self._inbox:
                return True
            self._cond.wait(timeout)
            return self._num_unfinished > 0 or bool(self._inbox)

    def stats(self) -> EngineStats:
        """Counts as of the last step; budget and policy as in force now."""
        s = self._stats
        return replace(s, token_budget=self.scheduler.token_budget, policy=self.scheduler.policy)

    def set_token_budget(self, value: object, source: str = "api") -> ControlEvent:
        return self._control(self.scheduler.set_token_budget(value), source)

    def set_policy(self, value: object, source: str = "api") -> ControlEvent:
        return self._control(self.scheduler.set_policy(value), source)

    def _control(self, result: ControlResult, source: str) -> ControlEvent:
        event = ControlEvent(
            key=result.key,
            old_value=result.old_value,
            new_value=result.new_value,
            accepted=result.accepted,
            time=time.time(),
            source=source,
            applied_at_step=result.applied_at_step,
            reason=result.reason,
        )
        if result.accepted:
            logger.info(
                "%s %s -> %s from step %s (%s)",
                result.key,
                result.old_value,
                result.new_value,
                result.applied_at_step,
                source,
            )
        self._emit([event])
        return event

    # --- the step (engine thread only) --------------------------------------------------------
    def step(self) -> StepResult:
        events: list[Event] = []
        outputs: list[RequestOutput] = []
        self._drain_inbox(events, outputs)
        start = time.time()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            self._update_stats()
            self._emit(events)
            return StepResult(None, outputs)
        for chunk in plan.chunks:
            req = chunk.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
                events.append(self._request_event("first_scheduled", req, start, plan.step))
        for req in plan.preempted:
            events.append(self._request_event("preempted", req, start, plan.step))
        try:
            sampled = self.runner.execute(plan)
        except Exception as exc:  # noqa: BLE001 - one bad step must not stop the engine
            logger.exception(
                "step %d failed; aborting its %d requests", plan.step, len(plan.chunks)
            )
            self._fail_plan(plan, str(exc), events, outputs)
            self._update_stats()
            self._emit(events)
            return StepResult(None, outputs)
        forward = self.runner.last_forward_time
        end = time.time()
        produced = self.scheduler.update(plan, sampled, end)
        for req in produced:
            if req.num_output_tokens == 1:
                events.append(self._request_event("first_token", req, end, plan.step))
            if req.status.finished:
                events.append(self._request_event("finished", req, end, plan.step))
                self._retire(req)
            outputs.append(self._output(req, [req.token_ids[-1]], [end]))
        self._update_stats()
        step_event = self._step_event(plan, start, end, forward)
        self._emit([step_event, *events])
        return StepResult(step_event, outputs)

    def _drain_inbox(self, events: list[Event], outputs: list[RequestOutput]) -> None:
        with self._cond:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, item in items:
            if kind == "add":
                assert isinstance(item, Request)
                self._requests[item.request_id] = item
                self.scheduler.add(item)
                events.append(self._request_event("arrived", item, item.arrival_time, None))
            else:
                req = self._requests.get(str(item))
                if req is None or req.status.finished:
                    continue
                self.scheduler.abort(req.request_id)
                now = time.time()
                events.append(self._request_event("aborted", req, now, None))
                self._retire(req)
                outputs.append(self._output(req, [], []))

    def _fail_plan(
        self, plan: StepPlan, error: str, events: list[Event], outputs: list[RequestOutput]
    ) -> None:
        now = time.time()
        for chunk in plan.chunks:
            req = chunk.request
            if req.status.finished:
                continue
            self.scheduler.abort(req.request_id)
            events.append(self._request_event("aborted", req, now, plan.step))
            self._retire(req)
            outputs.append(self._output(req, [], [], error=error))

    def _retire(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        self.runner.release(req)
        with self._cond:
            self._num_unfinished -= 1

    def _update_stats(self) -> None:
        s = self.scheduler
        self._stats = EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_total=self.block_manager.num_blocks,
            step=s.next_step,
            token_budget=s.token_budget,
            policy=s.policy,
        )

    def _step_event(self, plan: StepPlan, start: float, end: float, forward: float) -> StepEvent:
        return StepEvent(
            step=plan.step,
            start_time=start,
            end_time=end,
            token_budget=plan.token_budget,
            policy=plan.policy,
            num_decode_tokens=plan.num_decode_tokens,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            num_running=self._stats.num_running,
            num_waiting=self._stats.num_waiting,
            kv_blocks_used=self._stats.kv_blocks_used,
            kv_blocks_total=self._stats.kv_blocks_total,
            num_preemptions=len(plan.preempted),
            chunks=[
                ChunkRecord(c.request_id, c.kind, c.start, c.num_tokens, c.produces_token)
                for c in plan.chunks
            ],
            forward_time=forward,
        )

    @staticmethod
    def _request_event(kind: str, req: Request, when: float, step: int | None) -> RequestEvent:
        return RequestEvent(
            kind=kind,
            request_id=req.request_id,
            time=when,
            traffic_class=req.traffic_class,
            num_prompt_tokens=req.num_prompt_tokens,
            num_image_tokens=req.num_image_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            finish_reason=req.finish_reason,
            step=step,
        )

    @staticmethod
    def _output(
        req: Request, new: list[int], times: list[float], error: str | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new,
            token_times=times,
            finished=req.status.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_image_tokens=req.num_image_tokens,
            num_cached_tokens=req.num_cached_tokens,
            traffic_class=req.traffic_class,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            error=error,
        )

    def _emit(self, events: Iterable[Event]) -> None:
        for event in events:
            for fn in self._listeners:
                try:
                    fn(event)
                except Exception:  # noqa: BLE001 - an observer never stops the engine
                    logger.exception("event listener %r failed", fn)

    # --- offline use --------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams],
    ) -> list[GenerationResult]:
        """Run prompts to completion on this thread; results in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids: list[str] = []
        for prompt, p in zip(prompts, plist, strict=True):
            tokens = (
                self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else prompt
            )
            ids.append(self.add_request(tokens, p))
        results = {i: GenerationResult(i) for i in ids}
        while self.has_unfinished_requests():
            for out in self.step().outputs:
                r = results.get(out.request_id)
                if r is not None:
                    r.token_ids.extend(out.new_token_ids)
                    r.token_times.extend(out.token_times)
                    r.finish_reason = out.finish_reason
        for r in results.values():
            r.text = self.tokenizer.decode(r.token_ids)
        return [results[i] for i in ids]


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""


def _total_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


__all__ = [
    "EngineStats",
    "GenerationResult",
    "LLMEngine",
    "QueueFullError",
    "RequestOutput",
    "RequestStatus",
    "StepResult",
]
