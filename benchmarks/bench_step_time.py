"""Step time against tokens in the step (CPU, fp32, synthetic presets).

One prefill chunk of N tokens at position 0 (one step, budget N), and steady decode steps of B
running requests; median step time from the StepEvents. For the demo preset also the sizing
ratio (8,000-token prefill step) / (decode step of 8 streams), target >= 20x with a decode step
<= 40 ms.  -> results/step_time.json

Run from the repo root:  .venv/bin/python -m benchmarks.bench_step_time [--quick]
Torch threads are left at torch's default unless --threads is given (recorded either way).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

from benchmarks._common import (  # noqa: E402
    add_common_args,
    config_of,
    contention_probe,
    decode_steps,
    engine_config_dict,
    forward_s,
    make_engine,
    prefill_step,
    setup,
    summarize,
    table,
    write_json,
)


def bench_step_time(args: argparse.Namespace) -> dict[str, Any]:
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
            fwd = summarize([forward_s(e) for e, _ in evs])
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
            fwd = summarize([forward_s(e) for e, _ in evs])
            wall = summarize([w for _, w in evs])
            ovh = summarize([e.duration - forward_s(e) for e, _ in evs])
            ovh_wall = summarize([w - forward_s(e) for e, w in evs])
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
                "untimed run per N, then median StepEvent duration (end_ns - start_ns). "
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--presets", default="tiny,demo", help="comma-separated presets")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    args.presets = [p for p in args.presets.split(",") if p]
    t0 = time.perf_counter()
    res = bench_step_time(args)
    write_json(out_dir / "step_time.json", res, script="bench_step_time.py", config=config_of(args))
    print_step_time(res)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
