"""chunkscope's telemetry and live budget for a real vLLM, with no patch to vLLM.

Start vLLM with this scheduler class and a collector URL::

    CHUNKSCOPE_COLLECTOR_URL=ws://127.0.0.1:8765 python -m vllm.entrypoints.openai.api_server \\
        --model M --scheduler-cls chunkscope.integrations.vllm.ChunkscopeScheduler \\
        --max-num-batched-tokens 2048

(or ``chunkscope vllm -- --model M ...``). Without ``CHUNKSCOPE_COLLECTOR_URL`` the class is
vLLM's ``Scheduler`` and nothing more. With it, the class publishes chunkscope's wire
(docs/telemetry.md) through the engine's own publisher: a hello with vLLM's configuration, a
``step`` event per step that scheduled tokens (chunk layout included), request events with the
ids the OpenAI client sees, and applies ``token_budget`` controls relayed by the collector at
the top of the next ``schedule()``. Environment: ``CHUNKSCOPE_PUBLISH_TOKEN`` (the hello's
token), ``CHUNKSCOPE_CONTROL_TOKEN``, ``CHUNKSCOPE_ENGINE_ID`` (default ``vllm-<host>-<engine-core
pid>``, ``-dp<rank>`` added with data parallelism), ``CHUNKSCOPE_SPILL_DIR``.

vLLM builds the scheduler in its engine-core process and calls every method on that process's
one busy-loop thread, so ``schedule()`` and ``update_from_output()`` alternate (async scheduling,
which would overlap them, is detected and reported). No exception of the bridge reaches vLLM: a
fault is logged (the first of each place with its traceback) and counted, and vLLM serves on.
This is the only chunkscope module that imports vllm; the translation to events lives in
:mod:`chunkscope.integrations.vllm_events` (no vllm, no torch).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from chunkscope.integrations.vllm_events import (
    BridgeTiming,
    BudgetControl,
    StepTranslator,
    dp_identity,
    traffic_class_of,
)

# Under "vllm." so that vLLM's own logging configuration shows these lines.
logger = logging.getLogger("vllm.chunkscope")

ENV_URL = "CHUNKSCOPE_COLLECTOR_URL"
ENV_METRICS_URL = "CHUNKSCOPE_METRICS_URL"
# A test hook: while the file this names exists, the bridge's per-step code raises (the fault
# path that must never reach vLLM).
ENV_FAULT_FILE = "CHUNKSCOPE_BRIDGE_FAULT_FILE"
# every N steps the bridge logs its own time on the core thread (0: never); default 10000
ENV_TIMING_EVERY = "CHUNKSCOPE_BRIDGE_TIMING_EVERY"


CLOSE_TIMEOUT_S = 2.0


class BridgeFault(RuntimeError):
    """Raised by the bridge's own code on purpose (``CHUNKSCOPE_BRIDGE_FAULT_FILE``)."""


class _Bridge:
    """The bridge's state on one scheduler; every entry point is guarded by :meth:`guard`."""

    def __init__(self, sched: Scheduler, url: str) -> None:
        from engine.telemetry.buffer import BufferLimits
        from engine.telemetry.publisher import Publisher
        from wire.control import ControlRefused
        from wire.events import ClockAnchor

        self.faults = 0
        self._fault_places: set[str] = set()
        # steps vLLM ran that a fault left unrecorded since the last recorded one: (count, when
        # the first ran); declared by a ``gap`` event before the next recorded step
        self.unrecorded: tuple[int, int] | None = None
        self._fault_file = os.environ.get(ENV_FAULT_FILE) or None
        vc = sched.vllm_config
        sc = sched.scheduler_config
        self.unsupported = unsupported_features(vc)
        for what in self.unsupported:
            logger.warning("chunkscope: %s; steps and token times may be mis-recorded", what)
        self.policies: tuple[str, ...] = ("chunked",) if sc.enable_chunked_prefill else ()
        policy = "chunked" if sc.enable_chunked_prefill else "vllm-unchunked"
        self.start_budget = int(sched.max_num_scheduled_tokens)
        self.anchor = ClockAnchor.now()
        self.start_step_ns = 0
        self.exec_start_ns: int | None = None
        self.step_start_ns = 0
        self.randomized = not os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION")
        pc = vc.parallel_config
        dp, rank, dp_size = dp_identity(
            getattr(pc, "data_parallel_size", 1),
            getattr(pc, "data_parallel_rank", 0),
            getattr(pc, "data_parallel_index", None),
            multiprocessing.current_process().name,
        )
        engine_id = os.environ.get("CHUNKSCOPE_ENGINE_ID") or default_engine_id()
        if dp:
            engine_id = f"{engine_id}-dp{rank}"
        model = vc.model_config.served_model_name or vc.model_config.model
        if isinstance(model, list | tuple):
            model = model[0]
        self.publisher = Publisher(
            url,
            engine_id=engine_id,
            hello=lambda: self.hello(sched, str(model), rank, dp_size),
            token=os.environ.get("CHUNKSCOPE_PUBLISH_TOKEN")
            or os.environ.get("CHUNKSCOPE_COLLECTOR_TOKEN")  # older name
            or os.environ.get("CHUNKSCOPE_AUTH_TOKEN")
            or None,
            control_token=os.environ.get("CHUNKSCOPE_CONTROL_TOKEN") or None,
            apply_control=self.apply_control,
            limits=BufferLimits(spill_dir=os.environ.get("CHUNKSCOPE_SPILL_DIR") or None),
        )
        self.translator = StepTranslator(
            self.publisher.publish, self.anchor, policy=policy, randomized_ids=self.randomized
        )
        self.control = BudgetControl(
            self.translator,
            self.start_budget,
            self.policies,
            int(getattr(sc, "long_prefill_token_threshold", 0) or 0),
        )
        self._refused = ControlRefused
        if not int(getattr(vc, "shutdown_timeout", 0) or 0):
            logger.warning(
                "chunkscope: with --shutdown-timeout 0 vLLM kills this engine core right after "
                "SIGTERM, so its run ends without a goodbye and events not yet acknowledged "
                "are lost; start vLLM with --shutdown-timeout N (N > 0, `chunkscope vllm` "
                "passes 5) to let the bridge flush and say goodbye"
            )
        self.publisher.start()
        every = int(os.environ.get(ENV_TIMING_EVERY) or 10000)
        self.timing = BridgeTiming(every, self._publisher_cpu_ns) if every > 0 else None
        self.step_ns = 0  # the bridge's time on the core thread in the step in flight
        self._chain_sigterm(sched)
        logger.info(
            "chunkscope: vLLM engine %s publishing to %s (budget %d, controls: token_budget, "
            "long_prefill_token_threshold)",
            engine_id,
            self.publisher.url,
            self.start_budget,
        )

    def hello(self, sched: Scheduler, model: str, rank: int, dp_size: int | None) -> dict[str, Any]:
        vc = sched.vllm_config
        pool = sched.kv_cache_manager.block_pool
        return {
            "model": model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "core_pid": os.getpid(),
            "engine_mode": "vllm",
            "engine_kind": "vllm",
            "engine_version": vllm_version(),
            "policy": self.translator.policy,
            "policies": list(self.policies),
            "controls": ["token_budget", "long_prefill_token_threshold"]
            + (["policy"] if self.policies else []),
            "token_budget": self.control.budget,
            "long_prefill_token_threshold": self.control.cap,
            "max_token_budget": self.start_budget,
            "kv_blocks_total": int(pool.num_gpu_blocks),
            "block_size": int(vc.cache_config.block_size),
            "data_parallel_rank": rank,
            "data_parallel_size": dp_size,
            "unsupported": list(self.unsupported),
            "config": vllm_config_summary(vc),
            "clock": self.anchor.to_dict(),
            # vLLM's /metrics (`chunkscope vllm` sets it from --host/--port): listed by the
            # collector for Prometheus service discovery
            "metrics_url": os.environ.get(ENV_METRICS_URL) or None,
        }

    async def apply_control(self, changes: dict[str, Any], request_id: str | None) -> dict:
        try:
            return self.control.request(changes, source="collector", request_id=request_id)
        except ValueError as exc:  # ControlRefused of the engine's rule is a ValueError
            raise self._refused(str(exc)) from exc

    def check_fault(self) -> None:
        if self._fault_file is not None and os.path.exists(self._fault_file):
            raise BridgeFault(f"fault planted by {ENV_FAULT_FILE}={self._fault_file}")

    def fault(self, place: str) -> None:
        self.faults += 1
        if place not in self._fault_places:
            self._fault_places.add(place)
            logger.exception("chunkscope: bridge fault in %s (vLLM serves on; counted)", place)
        else:
            logger.warning("chunkscope: bridge fault in %s (%d so far)", place, self.faults)

    def _chain_sigterm(self, sched: Scheduler) -> None:
        """Close the publisher (flush + goodbye) once a SIGTERM'd core has drained: vLLM calls
        the scheduler's ``shutdown()`` only after its executor's teardown, which can outlast
        ``--shutdown-timeout`` (the core is then SIGKILLed). vLLM's own handler runs after ours.
        The scheduler is built on the core's main thread; elsewhere there is nothing to chain."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            try:
                threading.Thread(
                    target=self._close_when_drained, args=(sched,), name="chunkscope-stop",
                    daemon=True,
                ).start()  # fmt: skip
            except Exception:  # noqa: BLE001
                logger.exception("chunkscope: could not start the closing thread")
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:  # the default: die of it as without us
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _publisher_cpu_ns(self) -> int | None:
        thread = getattr(self.publisher, "_thread", None)
        if thread is None or thread.ident is None:
            return None
        return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))

    def timed_step(self, start_ns: int, end_ns: int) -> None:
        """One step done: its bridge time counted; the summary logged every N steps."""
        if self.timing is None:
            return
        line = self.timing.add(self.step_ns, end_ns - start_ns)
        self.step_ns = 0
        if line:
            logger.info(line)

    def _close_when_drained(self, sched: Scheduler) -> None:
        while sched.get_num_unfinished_requests() or self.translator._inflight is not None:
            time.sleep(0.01)
        self.close()

    def dropped_step(self, t_ns: int) -> None:
        n, first = self.unrecorded or (0, t_ns)
        self.unrecorded = (n + 1, first)

    def declare_unrecorded(self) -> None:
        """Publish the ``gap`` that declares the steps faults left unrecorded (none: nothing)."""
        if self.unrecorded is None:
            return
        n, first = self.unrecorded
        self.unrecorded = None
        self.publisher.publish(
            {
                "type": "gap",
                "time_ns": first,
                "num_steps_unrecorded": n,
                "reason": f"vLLM bridge fault: {n} step(s) vLLM ran were not recorded (their "
                "events are missing; see vLLM's log for the fault)",
            }
        )

    def close(self) -> None:
        line = self.timing.summary() if self.timing is not None else None
        if line:
            logger.info(line)
        # vLLM's process manager kills the core --shutdown-timeout s after its SIGTERM; a drain
        # may have used most of that, so the flush is short (at most one batch is unacknowledged
        # when the collector is up)
        self.publisher.close(timeout=CLOSE_TIMEOUT_S)


class ChunkscopeScheduler(Scheduler):
    """vLLM's ``Scheduler`` that reports into a chunkscope collector (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._chunkscope: _Bridge | None = None
        url = os.environ.get(ENV_URL)
        if not url:
            return
        try:
            self._chunkscope = _Bridge(self, url)
        except Exception:  # noqa: BLE001 - a bad URL or setup bug must not stop vLLM
            logger.exception("chunkscope: the bridge could not start; vLLM runs without it")
            self._chunkscope = None

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        bridge = self._chunkscope
        new = bridge is not None and request.request_id not in self.requests
        super().add_request(request)
        if bridge is None or not new:
            return
        try:
            params = getattr(request, "sampling_params", None)
            bridge.translator.arrived(
                request.request_id,
                request.arrival_time,
                int(request.num_prompt_tokens),
                traffic_class_of(getattr(params, "extra_args", None)),
            )
        except Exception:  # noqa: BLE001
            bridge.fault("add_request")

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: Any) -> Any:
        done = super().finish_requests(request_ids, finished_status)
        bridge = self._chunkscope
        if bridge is not None and done:
            try:
                bridge.translator.aborted([r.request_id for r in done])
            except Exception:  # noqa: BLE001
                bridge.fault("finish_requests")
        return done

    # --- steps ---------------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        bridge = self._chunkscope
        if bridge is None:
            return super().schedule(*args, **kwargs)
        start_ns = time.monotonic_ns()
        lock = bridge.translator.lock
        lock.acquire()
        try:
            try:
                changes = bridge.control.take()
                if "token_budget" in changes:
                    self.max_num_scheduled_tokens = changes["token_budget"]
                if "long_prefill_token_threshold" in changes:
                    # vLLM reads it from its scheduler config at every schedule()
                    self.scheduler_config.long_prefill_token_threshold = changes[
                        "long_prefill_token_threshold"
                    ]
            except Exception:  # noqa: BLE001
                bridge.fault("schedule (control)")
            budget = self.max_num_scheduled_tokens
            cap = int(self.scheduler_config.long_prefill_token_threshold or 0)
            t_sched = time.monotonic_ns()
            out = super().schedule(*args, **kwargs)
            t_after = time.monotonic_ns()
            try:
                self._chunkscope_scheduled(bridge, out, start_ns, budget, cap)
            except Exception:  # noqa: BLE001
                bridge.translator._inflight = None
                if getattr(out, "total_num_scheduled_tokens", 0):
                    bridge.dropped_step(start_ns)
                bridge.fault("schedule")
        finally:
            lock.release()
        bridge.exec_start_ns = time.monotonic_ns()
        bridge.step_start_ns = start_ns
        bridge.step_ns = (t_sched - start_ns) + (bridge.exec_start_ns - t_after)
        return out

    def _chunkscope_scheduled(
        self, bridge: _Bridge, out: Any, start_ns: int, budget: int, cap: int
    ) -> None:
        bridge.check_fault()
        if out.total_num_scheduled_tokens:
            bridge.declare_unrecorded()
        starts: dict[str, int] = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        # ScheduledChunk's fields as plain tuples (no object per chunk on the busy loop)
        chunks: list[tuple[str, int, int, int, int]] = []
        add = chunks.append
        requests = self.requests
        for rid, n in out.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None:
                continue
            start = starts.get(rid)
            add(
                (
                    rid,
                    req.num_computed_tokens - n if start is None else start,
                    n,
                    req.num_prompt_tokens,
                    req.num_tokens,
                )
            )
        pool = self.kv_cache_manager.block_pool
        total = int(pool.num_gpu_blocks)
        bridge.translator.scheduled(
            start_ns=start_ns,
            token_budget=budget,
            long_prefill_token_threshold=cap,
            chunks=chunks,
            preempted=sorted(out.preempted_req_ids or ()),
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=total - int(pool.get_num_free_blocks()),
            kv_blocks_total=total,
        )

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        bridge = self._chunkscope
        if bridge is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        end_ns = time.monotonic_ns()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        t_after = time.monotonic_ns()
        try:
            bridge.check_fault()
            produced: dict[str, int] = {}
            finished: dict[str, Any] = {}
            for eco in outputs.values():
                for o in eco.outputs:
                    if o.new_token_ids:
                        produced[o.request_id] = len(o.new_token_ids)
                    if o.finish_reason is not None:
                        finished[o.request_id] = o.finish_reason
            bridge.translator.executed(
                end_ns=end_ns,
                produced=produced,
                finished=finished,
                forward_start_ns=bridge.exec_start_ns,
                num_running=len(self.running),
                num_waiting=len(self.waiting),
            )
        except Exception:  # noqa: BLE001
            if bridge.translator._inflight is not None:
                bridge.dropped_step(bridge.exec_start_ns or end_ns)
            bridge.translator._inflight = None
            bridge.fault("update_from_output")
        try:
            done = time.monotonic_ns()
            bridge.step_ns += done - t_after
            bridge.timed_step(bridge.step_start_ns, done)
        except Exception:  # noqa: BLE001
            bridge.fault("timing")
        return outputs

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            bridge, self._chunkscope = self._chunkscope, None
            if bridge is not None:
                try:
                    bridge.close()
                except Exception:  # noqa: BLE001
                    logger.exception("chunkscope: closing the publisher failed")


def unsupported_features(vc: Any) -> list[str]:
    """What this vLLM configuration does that the bridge cannot record faithfully yet."""
    out = []
    if getattr(vc, "speculative_config", None) is not None:
        out.append("speculative decoding (several tokens per step per request)")
    if getattr(vc.scheduler_config, "async_scheduling", False):
        out.append("async scheduling (steps overlap)")
    if int(getattr(vc.parallel_config, "pipeline_parallel_size", 1) or 1) > 1:
        out.append("pipeline parallelism (several batches in flight)")
    return out


def vllm_config_summary(vc: Any) -> dict[str, Any]:
    """The parts of vLLM's configuration a reader of the store wants, as plain values."""
    sc, mc, cc, pc = vc.scheduler_config, vc.model_config, vc.cache_config, vc.parallel_config
    pick = {
        "model": getattr(mc, "model", None),
        "dtype": str(getattr(mc, "dtype", "")),
        "max_model_len": getattr(mc, "max_model_len", None),
        "max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
        "max_num_scheduled_tokens": getattr(sc, "max_num_scheduled_tokens", None),
        "max_num_seqs": getattr(sc, "max_num_seqs", None),
        "enable_chunked_prefill": getattr(sc, "enable_chunked_prefill", None),
        "long_prefill_token_threshold": getattr(sc, "long_prefill_token_threshold", None),
        "max_num_partial_prefills": getattr(sc, "max_num_partial_prefills", None),
        "async_scheduling": getattr(sc, "async_scheduling", None),
        "shutdown_timeout": getattr(vc, "shutdown_timeout", None),
        "block_size": getattr(cc, "block_size", None),
        "num_gpu_blocks": getattr(cc, "num_gpu_blocks", None),
        "enable_prefix_caching": getattr(cc, "enable_prefix_caching", None),
        "tensor_parallel_size": getattr(pc, "tensor_parallel_size", None),
        "pipeline_parallel_size": getattr(pc, "pipeline_parallel_size", None),
        "data_parallel_size": getattr(pc, "data_parallel_size", None),
        "device": str(getattr(getattr(vc, "device_config", None), "device", "")),
    }
    return {k: v if isinstance(v, int | float | str | bool | type(None)) else str(v)
            for k, v in pick.items()}  # fmt: skip


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "unknown"


def default_engine_id() -> str:
    host = socket.gethostname().split(".")[0]
    return f"vllm-{host}-{os.getpid()}"


__all__ = ["ChunkscopeScheduler", "unsupported_features", "vllm_config_summary"]
