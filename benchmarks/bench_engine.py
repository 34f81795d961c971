"""chunkscope engine benchmarks (CPU, fp32, synthetic presets).

Sections (``--sections``, default all):

  step        step time vs tokens in the step: one prefill chunk of N tokens at position 0,
              and steady decode steps of B running requests; the demo ratio
              (8,000-token prefill step) / (decode step of 8 streams)  -> results/step_time.json
  overhead    engine time outside the forward pass per decode step at 32 running requests,
              from the StepEvents, plus an instrumented breakdown  -> results/engine_overhead.json
  throughput  one seeded offline workload: LLMEngine (budget 512, 2048) vs HF generate (static
              batches) vs HF generate_batch (continuous batching); engine prefill tokens/s vs a
              plain forward of the same model  -> results/offline_throughput.json

Run from the repo root:  .venv/bin/python benchmarks/bench_engine.py [--quick]
Torch threads are left at torch's default (recorded in every JSON file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import (  # noqa: E402
    RESULTS_DIR,
    engine_config_dict,
    machine_info,
    make_engine,
    random_prompt,
    summarize,
    table,
    write_json,
)

from engine.sampling_params import SamplingParams  # noqa: E402

PAD_ID = 259
EOS_ID = 257
GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def drain(engine) -> None:  # type: ignore[no-untyped-def]
    """Abort everything still in the engine and step until it is empty."""
    for rid in list(engine._requests):  # noqa: SLF001 - benchmark bookkeeping only
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def prefill_step(engine, rng: random.Random, n: int) -> tuple[Any, float]:  # type: ignore[no-untyped-def]
    """One request of exactly n prompt tokens, budget n: a single prefill-only step."""
    engine.set_token_budget(n)
    engine.add_request(random_prompt(rng, n), GREEDY_1)
    t0 = time.perf_counter()
    res = engine.step()
    wall = time.perf_counter() - t0
    ev = res.event
    assert ev is not None and ev.num_prefill_tokens == n and ev.num_decode_tokens == 0, ev
    assert not engine.has_unfinished_requests(), "the 1-token request should have finished"
    return ev, wall


def decode_steps(  # type: ignore[no-untyped-def]
    engine, rng: random.Random, batch: int, prompt_len: int, warm: int, n: int, budget: int
) -> list[tuple[Any, float]]:
    """`batch` requests of prompt_len tokens; after their prefills, discard `warm` steady decode
    steps and return the next `n` (event, wall seconds of engine.step())."""
    engine.set_token_budget(budget)
    # the first requests start decoding while later ones still prefill: leave room for that
    prefill_steps = -(-batch * prompt_len // max(1, budget - batch)) + 1
    params = SamplingParams(
        max_tokens=warm + n + 4 + prefill_steps, temperature=0.0, ignore_eos=True
    )
    for _ in range(batch):
        engine.add_request(random_prompt(rng, prompt_len), params)
    out: list[tuple[Any, float]] = []
    seen = 0
    guard = 0
    while len(out) < n:
        guard += 1
        assert guard < 10_000
        t0 = time.perf_counter()
        res = engine.step()
        wall = time.perf_counter() - t0
        ev = res.event
        if ev is None:
            continue
        if ev.num_prefill_tokens == 0 and ev.num_decode_tokens == batch:
            seen += 1
            if seen > warm:
                out.append((ev, wall))
        elif seen:
            raise AssertionError(f"steady decode interrupted: {ev}")
    drain(engine)
    return out


@torch.inference_mode()
def plain_forward(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Our LlamaModel's weights, no paging/engine: contiguous causal SDPA, last-row logits."""
    t = ids.shape[0]
    pos = torch.arange(t)
    h = model.embed_tokens(ids)
    for layer in model.layers:
        a = layer.self_attn
        q, k, v = a.qkv_proj(layer.input_layernorm(h)).split([a.q_size, a.kv_size, a.kv_size], -1)
        q = q.view(t, a.num_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        q, k = model.rope(pos, q, k)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        h = h + a.o_proj(o[0].transpose(0, 1).reshape(t, a.q_size))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.compute_logits(model.norm(h)[-1:])


def timeit(fn, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    fn()  # warm-up, untimed
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def contention_probe() -> dict[str, Any]:
    """Machine state at this moment: 1-minute load average and a fixed fp32 GEMM's speed
    (2048x512 @ 512x1536, best and median of 10). Other processes on this small machine (e.g.
    concurrent test runs) make single timings noisy; these numbers let a reader judge a run."""
    a, w = torch.randn(2048, 512), torch.randn(512, 1536)
    a @ w
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        a @ w
        ts.append(time.perf_counter() - t0)
    flop = 2 * 2048 * 512 * 1536
    return {
        "loadavg_1m": os.getloadavg()[0],
        "gemm_gflops_best": flop / min(ts) / 1e9,
        "gemm_gflops_median": flop / statistics.median(ts) / 1e9,
    }


def load_hf(folder: str):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


# ------------------------------------------------------------------------------------------------
# 1. step time vs tokens in the step
# ------------------------------------------------------------------------------------------------
def bench_step_time(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    presets = args.presets
    chunks = (
        [64, 128, 256, 512, 1024, 2048]
        if args.quick
        else [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    )
    batches = [1, 2, 4, 8, 16, 32] if args.quick else [1, 2, 4, 8, 16, 32, 64]

    def reps_prefill(n: int) -> int:
        if args.quick:
            return 2 if n <= 512 else 1
        return 7 if n <= 1024 else 5 if n <= 2048 else 3

    decode_n = 5 if args.quick else 15
    decode_warm = 3
    prompt_len = args.decode_prompt_len
    out: dict[str, Any] = {
        "machine": machine,
        "presets": {},
        "contention_before": contention_probe(),
    }
    for preset in presets:
        max_len = 8192 + 256
        engine = make_engine(preset, token_budget=512, max_model_len=max_len)
        rng = random.Random(1)
        # global warm-up: one prefill and a few decode steps
        prefill_step(engine, rng, 512)
        decode_steps(engine, rng, 4, prompt_len, 1, 2, budget=2048)
        rows_p = []
        extra = [8000] if preset == "demo" and not args.quick else []
        for n in chunks + extra:
            prefill_step(engine, rng, n)  # untimed run of this configuration
            evs = [prefill_step(engine, rng, n) for _ in range(reps_prefill(n))]
            dur = summarize([e.duration for e, _ in evs])
            fwd = summarize([(e.forward_ns / 1e9) for e, _ in evs])
            wall = summarize([w for _, w in evs])
            rows_p.append(
                {
                    "chunk_tokens": n,
                    "reps": len(evs),
                    "step_ms": dur["median_ms"],
                    "step_ms_min": dur["min_ms"],
                    "step_time": dur,
                    "forward_time": fwd,
                    "step_call_wall": wall,
                    "tokens_per_s": n / (dur["median_ms"] / 1e3),
                    "tokens_per_s_best": n / (dur["min_ms"] / 1e3),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
            print(
                f"  [{preset}] prefill {n:5d}: {dur['median_ms']:9.2f} ms (min "
                f"{dur['min_ms']:.2f})",
                flush=True,
            )
        rows_d = []
        for b in batches:
            budget = max(2048, b)
            evs = decode_steps(engine, rng, b, prompt_len, decode_warm, decode_n, budget)
            dur = summarize([e.duration for e, _ in evs])
            fwd = summarize([(e.forward_ns / 1e9) for e, _ in evs])
            wall = summarize([w for _, w in evs])
            ovh = summarize([e.duration - (e.forward_ns / 1e9) for e, _ in evs])
            ovh_wall = summarize([w - (e.forward_ns / 1e9) for e, w in evs])
            rows_d.append(
                {
                    "batch": b,
                    "prompt_len": prompt_len,
                    "warmup_steps_discarded": decode_warm,
                    "steps": len(evs),
                    "step_ms": dur["median_ms"],
                    "step_ms_min": dur["min_ms"],
                    "step_time": dur,
                    "forward_time": fwd,
                    "step_call_wall": wall,
                    "overhead_event": ovh,
                    "overhead_step_call": ovh_wall,
                    "tokens_per_s": b / (dur["median_ms"] / 1e3),
                    "loadavg_1m": os.getloadavg()[0],
                }
            )
            print(
                f"  [{preset}] decode B={b:3d}: {dur['median_ms']:9.2f} ms (min "
                f"{dur['min_ms']:.2f})",
                flush=True,
            )
        entry: dict[str, Any] = {
            "engine_config": engine_config_dict(engine),
            "method": (
                "prefill: one request whose prompt is exactly N tokens, token_budget=N, one "
                "engine.step() (chunk at position 0, max_tokens=1, prefix caching off); one "
                "untimed run per N, then median StepEvent duration (end_time-start_time). "
                f"decode: B requests of {prompt_len}-token prompts, budget max(2048,B); after the "
                f"prefills, {decode_warm} steady decode steps discarded, then median of "
                f"{decode_n} steps with exactly B decode tokens."
            ),
            "prefill": rows_p,
            "decode": rows_d,
        }
        if preset == "demo":
            big = next((r for r in rows_p if r["chunk_tokens"] == 8000), None) or next(
                (r for r in rows_p if r["chunk_tokens"] == max(chunks)), None
            )
            d8 = next(r for r in rows_d if r["batch"] == 8)
            entry["key_ratio"] = {
                "prefill_chunk_tokens": big["chunk_tokens"],
                "prefill_step_ms": big["step_ms"],
                "decode_batch": 8,
                "decode_step_ms": d8["step_ms"],
                "ratio": big["step_ms"] / d8["step_ms"],
                "ratio_from_min_times": big["step_ms_min"] / d8["step_ms_min"],
                "decode_step_ms_min": d8["step_ms_min"],
                "prefill_step_ms_min": big["step_ms_min"],
                "target_ratio_min": 20,
                "target_decode_step_ms_max": 40,
                "meets_ratio": big["step_ms"] / d8["step_ms"] >= 20,
                "meets_decode": d8["step_ms"] <= 40,
            }
        out["presets"][preset] = entry
        del engine
    out["contention_after"] = contention_probe()
    return out


def print_step_time(res: dict[str, Any]) -> None:
    for preset, e in res["presets"].items():
        print(
            f"\n== step time, preset {preset} ({e['engine_config']['num_params'] / 1e6:.1f}M "
            "params) =="
        )
        rows = [
            [
                "prefill",
                r["chunk_tokens"],
                r["step_ms"],
                r["step_ms_min"],
                r["forward_time"]["median_ms"],
                r["tokens_per_s"],
            ]
            for r in e["prefill"]
        ]
        rows += [
            [
                "decode",
                r["batch"],
                r["step_ms"],
                r["step_ms_min"],
                r["forward_time"]["median_ms"],
                r["tokens_per_s"],
            ]
            for r in e["decode"]
        ]
        print(
            table(
                rows,
                ["kind", "tokens", "step ms (median)", "step ms (min)", "fwd ms", "tok/s (median)"],
            )
        )
        if "key_ratio" in e:
            k = e["key_ratio"]
            print(
                f"KEY RATIO demo: prefill {k['prefill_chunk_tokens']} = "
                f"{k['prefill_step_ms']:.1f} ms / "
                f"decode B=8 = {k['decode_step_ms']:.2f} ms -> {k['ratio']:.1f}x "
                f"(target >= 20: {'OK' if k['meets_ratio'] else 'MISS'}; decode <= 40 ms: "
                f"{'OK' if k['meets_decode'] else 'MISS'}); from min times: "
                f"{k['prefill_step_ms_min']:.1f} / {k['decode_step_ms_min']:.2f} -> "
                f"{k['ratio_from_min_times']:.1f}x"
            )


# ------------------------------------------------------------------------------------------------
# 3. engine overhead per decode step
# ------------------------------------------------------------------------------------------------
class _Timers:
    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


class _TimedModel:
    """Stands in for runner.model to time the model forward and the logits separately."""

    def __init__(self, model: Any, timers: _Timers) -> None:
        self._m = model
        self._timers = timers

    def __call__(self, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._m(*a, **kw)
        finally:
            self._timers.t["model_forward"] = (
                self._timers.t.get("model_forward", 0.0) + time.perf_counter() - t0
            )

    def compute_logits(self, h: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._m.compute_logits(h)
        finally:
            self._timers.t["compute_logits"] = (
                self._timers.t.get("compute_logits", 0.0) + time.perf_counter() - t0
            )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


def bench_overhead(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    batch = 32
    n = 10 if args.quick else 30
    warm = 3
    out: dict[str, Any] = {
        "machine": machine,
        "presets": {},
        "contention_before": contention_probe(),
    }
    for preset in args.presets:
        engine = make_engine(preset, token_budget=2048, max_model_len=4096)
        rng = random.Random(3)
        decode_steps(engine, rng, 4, args.decode_prompt_len, 1, 2, budget=2048)  # warm-up
        evs = decode_steps(engine, rng, batch, args.decode_prompt_len, warm, n, budget=2048)
        plain = {
            "step_time": summarize([e.duration for e, _ in evs]),
            "forward_time": summarize([(e.forward_ns / 1e9) for e, _ in evs]),
            "overhead_event": summarize([e.duration - (e.forward_ns / 1e9) for e, _ in evs]),
            "step_call_wall": summarize([w for _, w in evs]),
            "overhead_step_call": summarize([w - (e.forward_ns / 1e9) for e, w in evs]),
        }
        # Instrumented run: where does a decode step's time go? (instance-level wrappers only)
        timers = _Timers()
        runner, sched = engine.runner, engine.scheduler
        timers.wrap(sched, "schedule", "scheduler.schedule")
        timers.wrap(sched, "update", "scheduler.update")
        timers.wrap(runner, "execute", "runner.execute")
        timers.wrap(runner.backend, "prepare_metadata", "backend.prepare_metadata")
        timers.wrap(runner.sampler, "sample", "sampler.sample")
        real_model = runner.model
        runner.model = _TimedModel(real_model, timers)
        params = SamplingParams(max_tokens=warm + n + 8, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(random_prompt(rng, args.decode_prompt_len), params)
        parts: list[dict[str, float]] = []
        seen = 0
        while len(parts) < n:
            timers.t = {}
            t0 = time.perf_counter()
            ev = engine.step().event
            wall = time.perf_counter() - t0
            assert engine.has_unfinished_requests(), "requests finished before enough steps"
            if ev is None or ev.num_prefill_tokens or ev.num_decode_tokens != batch:
                continue
            seen += 1
            if seen <= warm:
                continue
            t = dict(timers.t)
            t["step_call_wall"] = wall
            t["runner.python_prep"] = (
                t["runner.execute"]
                - t["model_forward"]
                - t.get("compute_logits", 0)
                - t["backend.prepare_metadata"]
                - t.get("sampler.sample", 0)
            )
            t["step_rest (inbox, events, stats, emit)"] = (
                wall - t["runner.execute"] - t["scheduler.schedule"] - t["scheduler.update"]
            )
            t["outside_model_forward"] = wall - t["model_forward"]
            parts.append(t)
        runner.model = real_model
        drain(engine)
        keys = [
            "step_call_wall",
            "model_forward",
            "outside_model_forward",
            "scheduler.schedule",
            "backend.prepare_metadata",
            "runner.python_prep",
            "compute_logits",
            "sampler.sample",
            "scheduler.update",
            "step_rest (inbox, events, stats, emit)",
        ]
        breakdown = {k: statistics.median([p[k] for p in parts]) * 1e3 for k in keys}
        out["presets"][preset] = {
            "engine_config": engine_config_dict(engine),
            "running_requests": batch,
            "prompt_len": args.decode_prompt_len,
            "warmup_steps_discarded": warm,
            "method": (
                "overhead_event = (end_time - start_time) - forward_time of steady decode "
                "StepEvents; forward_time is the engine's (since commit 2cec940: the model "
                "forward + logits only), start_time is taken after draining the inbox and "
                "end_time right after runner.execute, so this covers scheduling, the runner's "
                "tensor building, attention metadata and sampling. overhead_step_call = wall "
                "time of engine.step() - forward_time (adds inbox drain, scheduler.update, "
                "event building/emission). breakdown_median_ms: a separate instrumented run "
                "(instance wrappers) splitting "
                "the step; 'outside_model_forward' = everything except the model's forward call."
            ),
            **plain,
            "target_ms": 3.0,
            "meets_target_event": plain["overhead_event"]["median_ms"] < 3.0,
            "meets_target_step_call": plain["overhead_step_call"]["median_ms"] < 3.0,
            "breakdown_median_ms": breakdown,
        }
        del engine
    out["contention_after"] = contention_probe()
    return out


def print_overhead(res: dict[str, Any]) -> None:
    print("\n== engine overhead per decode step, 32 running requests ==")
    rows = []
    for preset, e in res["presets"].items():
        rows.append(
            [
                preset,
                e["step_time"]["median_ms"],
                e["forward_time"]["median_ms"],
                e["overhead_event"]["median_ms"],
                e["overhead_event"]["p90_ms"],
                e["overhead_step_call"]["median_ms"],
                e["overhead_step_call"]["p90_ms"],
                e["breakdown_median_ms"]["outside_model_forward"],
            ]
        )
    print(
        table(
            rows,
            [
                "preset",
                "step ms",
                "fwd ms",
                "ovh(ev) med",
                "ovh(ev) p90",
                "ovh(call) med",
                "ovh(call) p90",
                "non-model ms",
            ],
        )
    )
    for preset, e in res["presets"].items():
        b = e["breakdown_median_ms"]
        print(
            f"  [{preset}] breakdown (median ms): "
            + ", ".join(f"{k}={v:.3f}" for k, v in b.items())
        )


# ------------------------------------------------------------------------------------------------
# 2. offline throughput
# ------------------------------------------------------------------------------------------------
def make_workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.workload_seed)
    lens = [rng.randint(args.prompt_min, args.prompt_max) for _ in range(args.num_requests)]
    return [random_prompt(rng, n) for n in lens]


def run_engine_workload(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = []
    t0 = time.perf_counter()
    for p in prompts:
        ids.append(engine.add_request(p, params))
    toks: dict[str, list[int]] = {i: [] for i in ids}
    events = []
    while engine.has_unfinished_requests():
        res = engine.step()
        if res.event is not None:
            events.append(res.event)
        for o in res.outputs:
            toks[o.request_id].extend(o.new_token_ids)
    wall = time.perf_counter() - t0
    outs = [toks[i] for i in ids]
    return {"wall_s": wall, "outputs": outs, "events": events}


def bench_throughput(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    prompts = make_workload(args)
    n_prompt = sum(len(p) for p in prompts)
    n_out = len(prompts) * args.max_new_tokens
    preset = args.throughput_preset
    repeats = 1 if args.quick else args.repeats
    workload = {
        "num_requests": len(prompts),
        "prompt_len_range": [args.prompt_min, args.prompt_max],
        "prompt_lens": [len(p) for p in prompts],
        "total_prompt_tokens": n_prompt,
        "max_new_tokens": args.max_new_tokens,
        "total_output_tokens": n_out,
        "seed": args.workload_seed,
        "sampling": "greedy, ignore_eos (every request produces exactly max_new_tokens)",
        "preset": preset,
        "dtype": "float32",
        "device": "cpu",
    }
    out: dict[str, Any] = {
        "machine": machine,
        "workload": workload,
        "contention_before": contention_probe(),
        "method": (
            f"one untimed warm-up per system, then {repeats} timed round(s), systems interleaved "
            "round-robin (contention hits all alike); wall_s = median over rounds, best = min. "
            "Output tok/s = total output tokens / wall; total tok/s counts prompt tokens too."
        ),
        "systems": {},
    }
    engine = make_engine(preset, token_budget=512, max_model_len=8192 + 256)
    out["engine_config"] = engine_config_dict(engine)
    model = engine.runner.model
    tmp = tempfile.mkdtemp(prefix="chunkscope_bench_")
    from engine.model.loader import save_hf_folder

    folder = str(save_hf_folder(model, tmp))
    hf = load_hf(folder)
    hf_attn = getattr(hf.config, "_attn_implementation", None)
    bs = args.hf_batch

    @torch.inference_mode()
    def hf_generate(ps: list[list[int]], max_new: int) -> list[list[int]]:
        res: list[list[int]] = []
        for i in range(0, len(ps), bs):
            batch = ps[i : i + bs]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            g = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
            )
            res.extend(row[width:].tolist() for row in g)
        return res

    # ---- (a) + (b): chunkscope at each budget, HF generate static batches -------------------
    def engine_run(
        budget: int, ps: list[list[int]], max_new: int
    ) -> tuple[list[list[int]], dict[str, Any]]:
        engine.set_token_budget(budget)
        r = run_engine_workload(engine, ps, max_new)
        evs = r["events"]
        return r["outputs"], {
            "num_steps": len(evs),
            "sum_forward_s": sum((e.forward_ns / 1e9) for e in evs),
            "sum_step_event_s": sum(e.duration for e in evs),
        }

    systems: dict[str, tuple[Any, dict[str, Any]]] = {}
    for b in args.budgets:
        systems[f"chunkscope_budget{b}"] = (
            lambda ps, mn, b=b: engine_run(b, ps, mn),
            {
                "system": "chunkscope LLMEngine",
                "token_budget": b,
                "prefix_caching": False,
                "policy": "chunked",
                "warmup": "full workload, untimed",
            },
        )
    systems["hf_generate_static"] = (
        lambda ps, mn: (hf_generate(ps, mn), {}),
        {
            "system": "transformers generate",
            "batch_size": bs,
            "padding": "left",
            "pad_token_id": PAD_ID,
            "min_new_tokens": args.max_new_tokens,
            "attn_implementation": hf_attn,
            "order": "workload order, no length sorting",
            "warmup": "one batch, untimed",
        },
    )
    for name, (fn, _) in systems.items():  # untimed warm-ups
        if args.quick:
            fn(prompts[:4], 2)
        elif name.startswith("chunkscope"):
            fn(prompts, args.max_new_tokens)
        else:
            fn(prompts[:bs], args.max_new_tokens)
    walls: dict[str, list[float]] = {k: [] for k in systems}
    outputs: dict[str, list[list[int]]] = {}
    extras: dict[str, dict[str, Any]] = {}
    for rnd in range(repeats):
        for name, (fn, _) in systems.items():
            t0 = time.perf_counter()
            o, extra = fn(prompts, args.max_new_tokens)
            walls[name].append(time.perf_counter() - t0)
            outputs.setdefault(name, o)
            extras.setdefault(name, extra)
            print(f"  round {rnd}: {name}: {walls[name][-1]:.2f} s", flush=True)
    ref = outputs[f"chunkscope_budget{args.budgets[0]}"]

    def record(
        name: str,
        runs: list[float],
        config: dict[str, Any],
        outs: list[list[int]] | None,
        **extra: Any,
    ) -> None:
        wall = statistics.median(runs)
        entry: dict[str, Any] = {
            "config": config,
            "wall_s": wall,
            "wall_s_runs": runs,
            "output_tokens_per_s": n_out / wall,
            "total_tokens_per_s": (n_out + n_prompt) / wall,
            "output_tokens_per_s_best": n_out / min(runs),
            **extra,
        }
        if outs is not None:
            entry["all_outputs_full_length"] = all(len(o) == args.max_new_tokens for o in outs)
            same = sum(a == b for a, b in zip(outs, ref, strict=True))
            entry[f"outputs_identical_to_chunkscope_budget{args.budgets[0]}"] = (
                f"{same}/{len(outs)}"
            )
        out["systems"][name] = entry

    for name, (_, cfg) in systems.items():
        record(name, walls[name], cfg, outputs[name], **extras[name])

    # ---- (c) HF continuous batching, in a child process (bounded by a timeout) ------------------
    wl_file = Path(tmp) / "workload.json"
    res_file = Path(tmp) / "cb_result.json"
    wl_file.write_text(
        json.dumps(
            {
                "prompts": prompts,
                "max_new_tokens": args.max_new_tokens,
                "quick": args.quick,
                "repeats": repeats,
            }
        )
    )
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_hf-cb-child",
        folder,
        str(wl_file),
        str(res_file),
    ]
    cb: dict[str, Any]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cb_timeout)
        if res_file.exists():
            cb = json.loads(res_file.read_text())
        else:
            cb = {
                "error": f"child exited {proc.returncode} without a result",
                "stderr_tail": proc.stderr[-4000:],
            }
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        cb = {"error": f"timed out after {args.cb_timeout} s", "stderr_tail": err[-4000:]}
    cb_cfg = {
        "system": "transformers generate_batch (continuous batching)",
        "process": "separate child process (same machine, threads default)",
        **cb.pop("config", {}),
    }
    if cb.get("wall_s_runs"):
        record("hf_generate_batch_cb", cb.pop("wall_s_runs"), cb_cfg, cb.pop("outputs"), **cb)
        print(
            f"  hf_generate_batch_cb: {out['systems']['hf_generate_batch_cb']['wall_s']:.2f} s",
            flush=True,
        )
    else:
        out["systems"]["hf_generate_batch_cb"] = {"config": cb_cfg, **cb}
        print(f"  hf_generate_batch_cb: FAILED: {cb.get('error')}", flush=True)

    base = out["systems"]
    ratios = {}
    for name, e in base.items():
        if not name.startswith("chunkscope") or "output_tokens_per_s" not in e:
            continue
        for other in ("hf_generate_static", "hf_generate_batch_cb"):
            if "output_tokens_per_s" in base.get(other, {}):
                ratios[f"{name}/{other}"] = (
                    e["output_tokens_per_s"] / base[other]["output_tokens_per_s"]
                )
    out["ratios_output_tokens_per_s"] = ratios

    # ---- prefill: engine (prefill-only steps) vs a plain forward of the same model --------------
    @torch.inference_mode()
    def hf_fwd(p: list[int]) -> Any:
        return hf(input_ids=torch.tensor([p]), use_cache=False, logits_to_keep=1).logits

    def plain_all() -> None:
        for p in prompts:
            plain_forward(model, torch.tensor(p))

    def hf_all() -> None:
        for p in prompts:
            hf_fwd(p)

    def engine_prefill(b: int) -> float:
        engine.set_token_budget(b)
        r = run_engine_workload(engine, prompts, 1)
        assert all(e.num_decode_tokens == 0 for e in r["events"])
        return sum(e.duration for e in r["events"])

    rounds = 1 if args.quick else 3
    pw: dict[str, list[float]] = {f"engine_budget{b}": [] for b in args.budgets}
    pw["plain_forward_ours"] = []
    pw["hf_forward_use_cache_false"] = []
    for b in args.budgets:  # warm-ups
        engine.set_token_budget(b)
        run_engine_workload(engine, prompts[:4], 1)
    plain_forward(model, torch.tensor(prompts[0]))
    hf_fwd(prompts[0])
    for _ in range(rounds):
        for b in args.budgets:
            pw[f"engine_budget{b}"].append(engine_prefill(b))
        t0 = time.perf_counter()
        plain_all()
        pw["plain_forward_ours"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_all()
        pw["hf_forward_use_cache_false"].append(time.perf_counter() - t0)
    how = {
        "plain_forward_ours": "our LlamaModel's weights, contiguous causal SDPA, no KV "
        "cache/paging, one prompt per call, last-row logits",
        "hf_forward_use_cache_false": "LlamaForCausalLM(input_ids=[prompt], use_cache=False, "
        "logits_to_keep=1), one prompt per call, attn={hf_attn}",
    }
    prefill_workload: dict[str, Any] = {
        "method": (
            f"the workload's {len(prompts)} prompts ({n_prompt} tokens), max_tokens=1 so every "
            f"engine step is prefill-only (engine packs several prompts per step up to the "
            f"budget; the baselines run one prompt per call). Engine time = sum of StepEvent "
            f"durations. {rounds} interleaved round(s): median and min."
        )
    }
    for k, runs in pw.items():
        prefill_workload[k] = {
            "sum_s_runs": runs,
            "tokens_per_s": n_prompt / statistics.median(runs),
            "tokens_per_s_best": n_prompt / min(runs),
            **({"how": how[k]} if k in how else {}),
        }
    for k, v in prefill_workload.items():
        if k.startswith("engine_"):
            for base_name, short in (
                ("plain_forward_ours", "plain_ours"),
                ("hf_forward_use_cache_false", "hf"),
            ):
                v[f"ratio_vs_{short}"] = (
                    v["tokens_per_s"] / prefill_workload[base_name]["tokens_per_s"]
                )
                v[f"ratio_vs_{short}_best"] = (
                    v["tokens_per_s_best"] / prefill_workload[base_name]["tokens_per_s_best"]
                )
    out["prefill_workload"] = prefill_workload

    # single chunk: one prompt of N tokens, engine step (budget N) vs plain vs HF, interleaved
    rng = random.Random(7)
    chunk_rows = []
    sizes = [512, 2048] if args.quick else [512, 2048, 8192]
    for n in sizes:
        reps = 2 if args.quick else (5 if n <= 2048 else 3)
        toks = random_prompt(rng, n)
        ids = torch.tensor(toks)
        engine.set_token_budget(n)
        engine.runner.keep_logits = True
        engine.runner.kept_logits.clear()
        t_eng: list[float] = []
        t_ours: list[float] = []
        t_hf: list[float] = []
        for i in range(reps + 1):  # i == 0: warm-up
            engine.add_request(toks, GREEDY_1, request_id=f"chunk{n}-{i}")
            ev = engine.step().event
            assert ev is not None and ev.num_prefill_tokens == n and ev.num_decode_tokens == 0
            t0 = time.perf_counter()
            plain_forward(model, ids)
            t1 = time.perf_counter()
            hf_fwd(toks)
            t2 = time.perf_counter()
            if i:
                t_eng.append(ev.duration)
                t_ours.append(t1 - t0)
                t_hf.append(t2 - t1)
        eng_logits = engine.runner.kept_logits[f"chunk{n}-0"][0]
        engine.runner.keep_logits = False
        engine.runner.kept_logits.clear()
        max_diff = float((plain_forward(model, ids)[0] - eng_logits).abs().max())
        e_med, o_med, h_med = (statistics.median(x) * 1e3 for x in (t_eng, t_ours, t_hf))
        e_min, o_min, h_min = (min(x) * 1e3 for x in (t_eng, t_ours, t_hf))
        chunk_rows.append(
            {
                "tokens": n,
                "reps": reps,
                "engine_step_ms": e_med,
                "plain_forward_ours_ms": o_med,
                "hf_forward_ms": h_med,
                "engine_step_ms_min": e_min,
                "plain_forward_ours_ms_min": o_min,
                "hf_forward_ms_min": h_min,
                "engine_tokens_per_s": n / e_med * 1e3,
                "engine_vs_plain_ours": o_med / e_med,
                "engine_vs_hf": h_med / e_med,
                "engine_vs_plain_ours_best": o_min / e_min,
                "engine_vs_hf_best": h_min / e_min,
                "max_abs_logit_diff_engine_vs_plain": max_diff,
            }
        )
        print(
            f"  prefill chunk {n}: engine {e_med:.1f} ms, plain {o_med:.1f} ms, hf {h_med:.1f} "
            f"ms (min {e_min:.1f}/{o_min:.1f}/{h_min:.1f})",
            flush=True,
        )
    out["prefill_single_chunk"] = chunk_rows
    out["prefill_target"] = "engine prefill tokens/s >= 90% of the plain forward (ratio >= 0.9)"
    out["contention_after"] = contention_probe()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return out


def hf_cb_child(folder: str, wl_file: str, res_file: str) -> None:
    """generate_batch in its own process; writes a JSON result or the error text."""
    from transformers import GenerationConfig

    wl = json.loads(Path(wl_file).read_text())
    prompts, max_new = wl["prompts"], wl["max_new_tokens"]
    result: dict[str, Any] = {
        "config": {
            "eos_token_id": -1,
            "do_sample": False,
            "max_new_tokens": max_new,
            "continuous_batching_config": "default",
        }
    }
    try:
        model = load_hf(folder)
        result["config"]["attn_implementation_before"] = getattr(
            model.config, "_attn_implementation", None
        )

        def gen_cfg(n: int) -> GenerationConfig:
            return GenerationConfig(
                max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID
            )

        t0 = time.perf_counter()
        model.generate_batch(
            inputs=prompts[:4] if wl["quick"] else prompts[:8],
            generation_config=gen_cfg(2 if wl["quick"] else 8),
        )
        result["warmup_s"] = time.perf_counter() - t0
        result["config"]["warmup"] = (
            "8 prompts x 8 tokens, untimed" if not wl["quick"] else "4 prompts x 2 tokens"
        )
        runs = []
        res: dict[str, Any] = {}
        for _ in range(wl["repeats"]):
            t0 = time.perf_counter()
            res = model.generate_batch(inputs=prompts, generation_config=gen_cfg(max_new))
            runs.append(time.perf_counter() - t0)
        result["config"]["attn_implementation_after"] = getattr(
            model.config, "_attn_implementation", None
        )
        by_id = list(res.items())
        outputs: list[list[int]] = [[] for _ in prompts]
        for rid, r in by_id:  # request ids end in the prompt's index ("req_12")
            tail = str(rid).rsplit("_", 1)[-1]
            if tail.isdigit() and int(tail) < len(outputs):
                outputs[int(tail)] = list(getattr(r, "generated_tokens", []) or [])
        result["request_ids_sample"] = [str(k) for k, _ in by_id[:3]]
        result["wall_s_runs"] = runs
        result["outputs"] = outputs
    except Exception as exc:  # noqa: BLE001 - record the failure text
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    Path(res_file).write_text(json.dumps(result))


def print_throughput(res: dict[str, Any]) -> None:
    w = res["workload"]
    print(
        f"\n== offline throughput: preset {w['preset']}, {w['num_requests']} requests, prompts "
        f"{w['prompt_len_range'][0]}..{w['prompt_len_range'][1]} ({w['total_prompt_tokens']} tok), "
        f"{w['max_new_tokens']} out each, greedy =="
    )
    rows = []
    for name, e in res["systems"].items():
        same = next((v for k, v in e.items() if k.startswith("outputs_identical")), "-")
        if "wall_s" in e:
            rows.append(
                [
                    name,
                    e["wall_s"],
                    e["output_tokens_per_s"],
                    e["output_tokens_per_s_best"],
                    e["total_tokens_per_s"],
                    same,
                ]
            )
        else:
            rows.append([name, "ERR", "-", "-", "-", (e.get("error") or "")[:60]])
    print(
        table(
            rows,
            [
                "system",
                "wall s (med)",
                "out tok/s",
                "out tok/s (best)",
                "total tok/s",
                "same tokens as engine",
            ],
        )
    )
    for k, v in res["ratios_output_tokens_per_s"].items():
        print(f"  ratio {k}: {v:.2f}x")
    print(
        "\n-- prefill tokens/s: engine (prefill-only steps) vs plain forward (target ratio >= "
        "0.9) --"
    )
    p = res["prefill_workload"]
    rows = []
    for k, v in p.items():
        if k == "method":
            continue
        if k.startswith("engine_"):
            rows.append(
                [
                    f"workload: {k}",
                    v["tokens_per_s"],
                    v["tokens_per_s_best"],
                    f"{v['ratio_vs_plain_ours']:.2f} / {v['ratio_vs_hf']:.2f}",
                    f"{v['ratio_vs_plain_ours_best']:.2f} / {v['ratio_vs_hf_best']:.2f}",
                ]
            )
        else:
            rows.append([f"workload: {k}", v["tokens_per_s"], v["tokens_per_s_best"], "-", "-"])
    for r in res["prefill_single_chunk"]:
        rows.append(
            [
                f"one chunk of {r['tokens']}: engine step",
                r["engine_tokens_per_s"],
                r["tokens"] / r["engine_step_ms_min"] * 1e3,
                f"{r['engine_vs_plain_ours']:.2f} / {r['engine_vs_hf']:.2f}",
                f"{r['engine_vs_plain_ours_best']:.2f} / {r['engine_vs_hf_best']:.2f}",
            ]
        )
    print(
        table(
            rows, ["what", "tok/s (med)", "tok/s (best)", "engine/plain, engine/hf (med)", "(best)"]
        )
    )


# ------------------------------------------------------------------------------------------------
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_hf-cb-child":
        hf_cb_child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="a < 2 minute version (fewer sizes and reps)"
    )
    ap.add_argument(
        "--sections",
        default="step,overhead,throughput",
        help="comma list of step,overhead,throughput",
    )
    ap.add_argument(
        "--presets", default="tiny,demo", help="presets for the step and overhead sections"
    )
    ap.add_argument("--throughput-preset", default="demo")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--workload-seed", type=int, default=1234)
    ap.add_argument("--budgets", default="512,2048")
    ap.add_argument("--hf-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per offline system")
    ap.add_argument(
        "--cb-timeout", type=int, default=300, help="seconds for the generate_batch child"
    )
    ap.add_argument("--out-dir", default=str(RESULTS_DIR))
    ap.add_argument("--suffix", default="", help="appended to result file names (e.g. _quick)")
    args = ap.parse_args()
    args.presets = [p for p in args.presets.split(",") if p]
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.max_new_tokens = min(args.max_new_tokens, 16)
        args.cb_timeout = min(args.cb_timeout, 90)
        if not args.suffix:
            args.suffix = "_quick"
    logging.basicConfig(level=logging.WARNING)
    sections = [s for s in args.sections.split(",") if s]
    machine = machine_info()
    print(
        f"machine: {machine['cpu_count']} cpus, torch {machine['torch_version']} "
        f"({machine['torch_num_threads']} threads), transformers {machine['transformers_version']}"
    )
    out_dir = Path(args.out_dir)
    argd = {k: v for k, v in vars(args).items()}
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    if "step" in sections:
        r = bench_step_time(args, machine)
        r["args"] = argd
        write_json(out_dir / f"step_time{args.suffix}.json", r)
        results["step"] = r
    if "overhead" in sections:
        r = bench_overhead(args, machine)
        r["args"] = argd
        write_json(out_dir / f"engine_overhead{args.suffix}.json", r)
        results["overhead"] = r
    if "throughput" in sections:
        r = bench_throughput(args, machine)
        r["args"] = argd
        write_json(out_dir / f"offline_throughput{args.suffix}.json", r)
        results["throughput"] = r
    if "step" in results:
        print_step_time(results["step"])
    if "overhead" in results:
        print_overhead(results["overhead"])
    if "throughput" in results:
        print_throughput(results["throughput"])
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
