"""GPU paths: CUDA SDPA, compiled flex (bf16) and flash-attn against an fp32 CPU reference.
Skipped without CUDA; the flash-attn test also needs `flash_attn` to import. On the GPU machine
(no openai or httpx there) run them with ``python3 -m pytest -q --noconftest -m gpu``
and this file and ``tests/engine/model/test_attention_flex.py``."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _last_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    engine.runner.keep_logits = True
    engine.runner.kept_logits.clear()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.runner.kept_logits[rid][0].float()


def _compare(backend: str, block_size: int) -> None:
    prompt = [random.Random(0).randrange(256) for _ in range(1000)]
    ref = _last_logits(
        LLMEngine(
            EngineConfig(model="demo", device="cpu", token_budget=1000, max_token_budget=1000)
        ),
        prompt,
    )
    for budget in (64, 1000):
        gpu = LLMEngine(
            EngineConfig(
                model="demo",
                device="cuda",
                dtype="bfloat16",
                attention_backend=backend,
                block_size=block_size,
                token_budget=budget,
                max_token_budget=1000,
                num_kv_blocks=64 if block_size == 256 else 1024,
            )
        )
        got = _last_logits(gpu, prompt).cpu()
        # bf16 vs fp32: compare the distributions, not bits
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.99
        assert (got - ref).abs().max() < 0.1 * ref.abs().max()


@needs_cuda
def test_cuda_sdpa_matches_fp32_reference() -> None:
    _compare("sdpa", 16)


@needs_cuda
def test_cuda_flex_matches_fp32_reference() -> None:
    _compare("flex", 128)


@needs_cuda
def test_flash_attn_matches_fp32_reference() -> None:
    pytest.importorskip("flash_attn")
    _compare("flash", 256)
