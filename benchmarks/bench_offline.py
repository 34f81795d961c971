"""Offline throughput on one seeded workload, against transformers, and prefill against a plain
forward (CPU, fp32, demo preset by default).

Systems, interleaved round-robin after an untimed warm-up each (contention hits all alike):

  chunkscope LLMEngine   every request added at once, ``step()`` until done; one run per budget
  transformers generate  static batches of ``--hf-batch`` prompts in workload order, left padding,
                         ``min_new_tokens = max_new_tokens`` (so every row generates them all)
  transformers generate_batch  continuous batching (default config), in a child process bounded
                         by ``--cb-timeout``; warm-up 8 prompts x 8 tokens

All use the same weights (the engine's synthetic model saved as a Hugging Face folder), fp32,
greedy decoding, and torch's default thread count in this process (recorded in provenance).
Prefill: the workload's prompts with max_tokens=1 through the engine (several prompts per step)
against a plain forward of the same model (contiguous causal SDPA, one prompt per call) and
transformers' forward; then single chunks of 512 / 2,048 / 8,192 tokens.
-> results/offline_throughput.json

Run from the repo root:  .venv/bin/python -m benchmarks.bench_offline [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._common import (  # noqa: E402
    add_common_args,
    config_of,
    contention_probe,
    engine_config_dict,
    forward_s,
    make_engine,
    random_prompt,
    setup,
    table,
    write_json,
)
from engine.core.sampling_params import SamplingParams  # noqa: E402

PAD_ID = 259
EOS_ID = 257
GREEDY_1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
CB_CHILD_FLAG = "--_hf-cb-child"


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


def load_hf(folder: str):  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


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


def bench_throughput(args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_workload(args)
    n_prompt = sum(len(p) for p in prompts)
    n_out = len(prompts) * args.max_new_tokens
    preset = args.preset
    repeats = args.repeats
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
            "sum_forward_s": sum(forward_s(e) for e in evs),
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
        CB_CHILD_FLAG,
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
        f"logits_to_keep=1), one prompt per call, attn={hf_attn}",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == CB_CHILD_FLAG:
        hf_cb_child(*argv[1:4])
        return 0
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--workload-seed", type=int, default=1234)
    ap.add_argument("--budgets", default="512,2048", help="engine token budgets to compare")
    ap.add_argument("--hf-batch", type=int, default=8, help="static batch size for generate")
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per system")
    ap.add_argument(
        "--cb-timeout", type=int, default=300, help="seconds for the generate_batch child"
    )
    args = ap.parse_args(argv)
    out_dir = setup(args)
    args.budgets = [int(b) for b in args.budgets.split(",")]
    if args.quick:
        args.num_requests = min(args.num_requests, 16)
        args.max_new_tokens = min(args.max_new_tokens, 16)
        args.cb_timeout = min(args.cb_timeout, 90)
        args.repeats = 1
    t0 = time.perf_counter()
    res = bench_throughput(args)
    write_json(
        out_dir / "offline_throughput.json", res, script="bench_offline.py", config=config_of(args)
    )
    print_throughput(res)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
