"""Turn the logits of the positions that produce a token into tokens, per request's params."""

from __future__ import annotations

import torch

from engine.core.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.default_generator = torch.Generator(device="cpu").manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device="cpu").manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        """logits: [N, V] float32, one row per request."""
        greedy = logits.argmax(dim=-1).tolist()
        if all(p.greedy for p in params):
            return greedy
        out = list(greedy)
        rows = logits.float().cpu()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            row = rows[i] / p.temperature
            if p.top_k > 0 and p.top_k < row.shape[0]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(row, descending=True)
                probs = sorted_logits.softmax(-1)
                cum = probs.cumsum(-1)
                drop = cum - probs > p.top_p  # keep the smallest prefix whose mass reaches top_p
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
            probs = row.softmax(-1)
            gen = self._generator(request_ids[i], p)
            out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
        return out
