"""A terminal demo: chat streams decode while a long RAG prompt arrives, once per policy.

Prints one line per step (budget in force, decode and prefill tokens, a bar of budget use, step
time) and then, per policy, the worst stall the streaming requests saw. Run:

    python -m engine.demo [--model demo] [--token-budget 256] [--long-prompt 8000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine


def _bar(ev_decode: int, ev_prefill: int, budget: int, width: int = 32) -> str:
    scale = width / max(budget, ev_decode + ev_prefill)
    d = round(ev_decode * scale)
    p = round(ev_prefill * scale)
    return ("=" * d + "#" * p).ljust(width)


def run_phase(engine: LLMEngine, policy: str, long_prompt: int, streams: int, quiet: bool) -> float:
    rng = random.Random(policy)  # a different RAG document per phase: no prefix-cache hit
    engine.set_policy(policy, source="demo")
    chat = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
    watched = engine.add_request(
        engine.tokenizer.encode("<|user|>\nTell me a story.\n", True), chat
    )
    for _ in range(streams - 1):
        engine.add_request([rng.randrange(32, 127) for _ in range(64)], chat)
    gaps: list[float] = []
    last: dict[str, float] = {}
    text: list[int] = []
    step = 0
    print(
        f"\n--- policy {policy}, budget {engine.token_budget}: {streams} chat streams, then a "
        f"{long_prompt:,}-token RAG prompt ('=' decode, '#' prefill) ---"
    )
    while engine.has_unfinished_requests():
        if step == 6:
            rag = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            engine.add_request([rng.randrange(32, 127) for _ in range(long_prompt)], rag)
        res = engine.step()
        step += 1
        ev = res.event
        if ev is None:
            continue
        for out in res.outputs:
            for t in out.token_times:
                if out.request_id in last:
                    gaps.append(t - last[out.request_id])
                last[out.request_id] = t
            if out.request_id == watched:
                text.extend(out.new_token_ids)
        if not quiet:
            print(
                f"step {ev.step:4d} budget {ev.token_budget:5d} decode {ev.num_decode_tokens:3d} "
                f"prefill {ev.num_prefill_tokens:5d} "
                f"|{_bar(ev.num_decode_tokens, ev.num_prefill_tokens, ev.token_budget)}| "
                f"{ev.duration * 1000:7.1f} ms"
            )
    worst = max(gaps) if gaps else 0.0
    print(f"streamed text of one chat request: {engine.tokenizer.decode(text)!r}")
    print(
        f"inter-token latency of the chat streams: median {statistics.median(gaps) * 1000:.1f} ms, "
        f"worst stall {worst * 1000:.0f} ms"
    )
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", default="demo", help="preset name or local model folder")
    ap.add_argument("--token-budget", type=int, default=256, help="tokens per step (chunked)")
    ap.add_argument("--long-prompt", type=int, default=8000, help="RAG prompt length in tokens")
    ap.add_argument("--streams", type=int, default=8, help="concurrent chat streams")
    ap.add_argument("--quiet", action="store_true", help="only print the summaries")
    args = ap.parse_args(argv)
    try:
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                token_budget=args.token_budget,
                max_token_budget=max(args.token_budget, 8192),
            )
        )
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chunked = run_phase(engine, "chunked", args.long_prompt, args.streams, args.quiet)
    unchunked = run_phase(engine, "unchunked", args.long_prompt, args.streams, args.quiet)
    print(
        f"\nworst chat stall: chunked {chunked * 1000:.0f} ms vs unchunked "
        f"{unchunked * 1000:.0f} ms ({unchunked / max(chunked, 1e-9):.1f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
