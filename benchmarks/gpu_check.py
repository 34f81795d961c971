"""GPU checks in one bounded script (on a CUDA machine; writes benchmarks/results/gpu_check.json).

1. Correctness: last-position logits of the CUDA SDPA path (bf16) and, when flash-attn imports,
   the flash-attn path, against the same model in fp32 on the CPU, at two budgets.
2. Throughput against the measured roofline: a bf16 GEMM gives the achievable FLOP/s and a device
   copy the achievable bandwidth; prefill steps (compute bound) are compared with the FLOP/s
   roofline, decode steps (memory bound: weights + KV read once) with the bandwidth roofline.

    python benchmarks/gpu_check.py [--model llama3.2-1b] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_common_args, config_of, setup, write_json  # noqa: E402

from engine.attention import flash_attn_available  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def measured_roofline() -> dict[str, float]:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    flops = 2 * n**3 * reps / (time.perf_counter() - t)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    return {"bf16_gemm_tflops": flops / 1e12, "copy_bandwidth_gbs": bw / 1e9}


def last_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    engine.runner.keep_logits = True
    engine.runner.kept_logits.clear()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.runner.kept_logits[rid][0].float().cpu()


def correctness(model: str) -> list[dict[str, object]]:
    prompt = [random.Random(0).randrange(256) for _ in range(2000)]
    ref_engine = LLMEngine(
        EngineConfig(
            model=model,
            device="cpu",
            dtype="float32",
            token_budget=2048,
            max_token_budget=2048,
            max_model_len=4096,
            num_kv_blocks=300,
        )
    )
    ref = last_logits(ref_engine, prompt)
    del ref_engine
    rows = []
    backends = [("sdpa", 16)] + ([("flash", 256)] if flash_attn_available() else [])
    for backend, bs in backends:
        for budget in (128, 2048):
            eng = LLMEngine(
                EngineConfig(
                    model=model,
                    device="cuda",
                    attention_backend=backend,
                    block_size=bs,
                    token_budget=budget,
                    max_token_budget=2048,
                    max_model_len=4096,
                    num_kv_blocks=max(64, 8192 // bs),
                )
            )
            got = last_logits(eng, prompt)
            rows.append(
                {
                    "backend": backend,
                    "block_size": bs,
                    "budget": budget,
                    "dtype": "bfloat16",
                    "cosine_vs_fp32": float(torch.nn.functional.cosine_similarity(got, ref, dim=0)),
                    "max_abs_err": float((got - ref).abs().max()),
                    "ref_max_abs": float(ref.abs().max()),
                    "argmax_equal": int(got.argmax()) == int(ref.argmax()),
                }
            )
            del eng
            torch.cuda.empty_cache()
    if not flash_attn_available():
        rows.append({"backend": "flash", "skipped": "flash_attn does not import here"})
    return rows


def throughput(model: str, quick: bool, roof: dict[str, float]) -> dict[str, object]:
    eng = LLMEngine(
        EngineConfig(
            model=model,
            device="cuda",
            token_budget=8192,
            max_token_budget=8192,
            enable_prefix_caching=False,
        )
    )
    arch = eng.arch
    params = arch.num_params
    rng = random.Random(1)
    out: dict[str, object] = {"model": model, "params": params, "prefill": [], "decode": []}
    for n in [512, 2048] if quick else [512, 1024, 2048, 4096, 8192]:
        eng.set_token_budget(n)
        times = []
        for _ in range(3):
            eng.add_request(
                [rng.randrange(256) for _ in range(n)],
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
            ev = eng.step().event
            assert ev is not None
            times.append(ev.duration)
        t = sorted(times)[1]
        flops = 2 * params * n  # attention FLOPs excluded: the roofline ratio is a lower bound
        out["prefill"].append(
            {
                "tokens": n,
                "step_ms": t * 1e3,
                "tokens_per_s": n / t,
                "fraction_of_gemm_roofline": flops / t / (roof["bf16_gemm_tflops"] * 1e12),
            }
        )
    eng.set_token_budget(8192)
    for batch in [8, 64] if quick else [1, 8, 32, 64, 128]:
        for _ in range(batch):
            eng.add_request(
                [rng.randrange(256) for _ in range(512)],
                SamplingParams(max_tokens=40, ignore_eos=True),
            )
        times = []
        while eng.has_unfinished_requests():
            ev = eng.step().event
            if ev is not None and ev.num_prefill_tokens == 0 and ev.num_decode_tokens == batch:
                times.append(ev.duration)
        t = sorted(times[5:])[len(times[5:]) // 2]
        bytes_read = params * 2 + batch * 552 * arch.kv_bytes_per_token(2)
        out["decode"].append(
            {
                "batch": batch,
                "step_ms": t * 1e3,
                "tokens_per_s": batch / t,
                "fraction_of_bandwidth_roofline": bytes_read
                / t
                / (roof["copy_bandwidth_gbs"] * 1e9),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llama3.2-1b", help="preset for the throughput part")
    add_common_args(ap)
    args = ap.parse_args(argv)
    out_dir = setup(args)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["roofline"] = roof = measured_roofline()
    print("roofline", roof, flush=True)
    result["correctness"] = correctness("demo")
    print(json.dumps(result["correctness"], indent=1), flush=True)
    result["throughput"] = throughput(args.model, args.quick, roof)
    print(json.dumps(result["throughput"], indent=1), flush=True)
    write_json(out_dir / "gpu_check.json", result, script="gpu_check.py", config=config_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
