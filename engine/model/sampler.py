"""Turn the logits of the positions that produce a token into tokens, per request's params.

Each sampled (non-greedy) row is drawn on its own, so a row that cannot be sampled (its
probabilities are not finite, its seed does not fit the generator) fails that request alone:
its entry in the result is a :class:`SampleFailure` and every other row is sampled as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleFailure:
    """Why one request's row could not be sampled."""

    error: str


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
    ) -> list[int | SampleFailure]:
        """logits: [N, V] float32, one row per request. A row whose sampling raises gets a
        ``SampleFailure``; the others their token."""
        greedy = logits.argmax(dim=-1).tolist()
        if all(p.greedy for p in params):
            return greedy
        out: list[int | SampleFailure] = list(greedy)
        rows = logits.float().cpu()
        for i, p in enumerate(params):
            if p.greedy:
                continue
            try:
                out[i] = self._sample_row(rows[i], request_ids[i], p)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                out[i] = SampleFailure(f"sampling failed: {type(exc).__name__}: {exc}")
        return out

    def _sample_row(self, row: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        row = row / p.temperature
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
        gen = self._generator(request_id, p)
        # multinomial on the CPU raises for inf, NaN or negative entries and for an all-zero
        # row: exactly the rows that must fail alone.
        return int(torch.multinomial(probs, 1, generator=gen).item())
