"""Image prompts and the stall: what one image request does to streaming chats, per budget.

In process (``LLMEngine``, CPU fp32, ``demo`` preset): ``--streams`` chat requests decode, then a
request with one image (720p by default: 1,196 image tokens after Qwen2-VL resizing) arrives and
the engine steps until its first token. Per budget: the median decode-only step before it, the
longest step while the image prompt prefills (vision encoder included: the encoder runs band by
band with the chunks, see ``engine/model/vision.py``), their ratio (the spike a chat stream sees),
the number of steps, and the image request's TTFT. Each case runs ``--repeats`` times (median
reported, all kept); budgets alternate within a repeat so background load hits them alike.

    .venv/bin/python -m benchmarks.vlm_stall [--budgets 16384,512,256] [--quick]

Writes benchmarks/results/vlm_stall.json (provenance and full configuration included).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from typing import Any

import numpy as np

from benchmarks._common import add_common_args, config_of, setup, table, write_json  # noqa: E402
from engine.core.config import EngineConfig
from engine.core.request import ImageInput  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.server.multimodal import resize_image  # noqa: E402


def make_image(height: int, width: int, seed: int) -> ImageInput:
    rng = np.random.default_rng(seed)
    pixels = resize_image(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return ImageInput(pixels, hashlib.sha256(pixels.tobytes()).hexdigest())


def one_case(
    engine: LLMEngine, budget: int, streams: int, image: ImageInput, seed: int
) -> dict[str, Any]:
    tok = engine.tokenizer
    engine.set_token_budget(engine.max_token_budget)
    chats = [
        engine.add_request(
            tok.encode(f"chat {seed} {i}: tell me a story", add_bos=True),
            SamplingParams(max_tokens=2000, ignore_eos=True),
        )
        for i in range(streams)
    ]
    baseline: list[float] = []
    while len(baseline) < 12:
        ev = engine.step().event
        if ev is not None and ev.num_prefill_tokens == 0 and ev.num_decode_tokens == streams:
            baseline.append(ev.duration)
    engine.set_token_budget(budget)
    assert tok.image_token_id is not None
    prompt = (
        tok.encode(f"<|user|>\n{seed}", add_bos=True)
        + [tok.image_token_id] * image.num_tokens
        + tok.encode(" describe the picture\n<|assistant|>\n")
    )
    t0 = time.monotonic()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), images=[image])
    during: list[Any] = []
    ttft = None
    while ttft is None:
        res = engine.step()
        if res.event is not None:
            during.append(res.event)
        if any(o.request_id == rid and o.new_token_ids for o in res.outputs):
            ttft = time.monotonic() - t0
    for r in [*chats, rid]:
        engine.abort_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    base = statistics.median(baseline)
    longest = max(e.duration for e in during)
    return {
        "budget": budget,
        "prompt_tokens": len(prompt),
        "image_tokens": image.num_tokens,
        "baseline_decode_step_ms": base * 1e3,
        "steps": len(during),
        "max_step_ms": longest * 1e3,
        "spike_ratio": longest / base,
        "image_request_ttft_ms": ttft * 1e3,
        "step_ms": [round(e.duration * 1e3, 2) for e in during],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budgets", default="16384,512,256")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--image", default="1280x720", help="WIDTHxHEIGHT before resizing")
    ap.add_argument("--repeats", type=int, default=3)
    add_common_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.image, args.repeats = "tiny", "448x280", 1
        args.budgets = "1024,64"
    out_dir = setup(args)
    budgets = [int(b) for b in args.budgets.split(",")]
    width, height = (int(x) for x in args.image.split("x"))
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            dtype="float32",
            token_budget=max(budgets),
            max_token_budget=max(budgets),
            enable_prefix_caching=False,
        )
    )
    image = make_image(height, width, seed=0)
    one_case(engine, max(budgets), args.streams, image, seed=-1)  # warm-up
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
    for rep in range(args.repeats):
        for b in budgets:
            runs[b].append(one_case(engine, b, args.streams, image, seed=rep))
    cases = []
    for b in budgets:
        keys = ("baseline_decode_step_ms", "max_step_ms", "spike_ratio", "image_request_ttft_ms")
        med = {k: statistics.median(r[k] for r in runs[b]) for k in keys}
        cases.append({"budget": b, "steps": runs[b][0]["steps"], **med, "runs": runs[b]})
    big, small = cases[0], cases[-1]
    result = {
        "image": {"requested": args.image, "resized_hw": list(image.pixels.shape[:2])},
        "image_tokens": image.num_tokens,
        "cases": cases,
        "max_step_ratio_first_over_last": big["max_step_ms"] / small["max_step_ms"],
        "ttft_ratio_last_over_first": small["image_request_ttft_ms"] / big["image_request_ttft_ms"],
    }
    print(
        table(
            [
                [
                    c["budget"],
                    c["steps"],
                    c["baseline_decode_step_ms"],
                    c["max_step_ms"],
                    c["spike_ratio"],
                    c["image_request_ttft_ms"],
                ]
                for c in cases
            ],
            ["budget", "steps", "decode step ms", "max step ms", "spike x", "image TTFT ms"],
        )
    )
    print(
        f"max step {big['budget']} / {small['budget']}: "
        f"{result['max_step_ratio_first_over_last']:.1f}x; image TTFT "
        f"{small['budget']} / {big['budget']}: {result['ttft_ratio_last_over_first']:.2f}x"
    )
    write_json(out_dir / "vlm_stall.json", result, script="vlm_stall.py", config=config_of(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
