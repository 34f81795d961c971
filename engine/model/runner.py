"""Runs one StepPlan: builds the step's tensors, one forward over the mixed batch, samples."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.core.request import Request
from engine.core.scheduler import StepPlan
from engine.model.attention.common import AttentionBackend, SeqSlice
from engine.model.llama import LlamaModel
from engine.model.sampler import SampleFailure, Sampler

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend,
        seed: int = 0,
        vision: Any = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.vision = vision
        arch = model.arch
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(arch.num_hidden_layers)
        ]
        self.sampler = Sampler(device, seed)
        # When set, the logits behind every sampled token are kept per request (for tests and
        # debugging: they are what a one-shot prefill must reproduce).
        self.keep_logits = False
        # Seconds of the last step spent in the model's forward pass and logits (the rest of a
        # step - scheduling, tensor building, sampling, bookkeeping - is engine overhead).
        self.last_forward_time = 0.0
        self._encoder_time = 0.0  # of the current step: the vision encoder runs before t0
        self.kept_logits: dict[str, list[torch.Tensor]] = {}
        # request id -> why its sampling failed, for the last ``execute``
        self.sample_errors: dict[str, str] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    def execute(self, plan: StepPlan) -> dict[str, int]:
        """Run the model over every chunk of the plan; return the sampled token of each request
        whose chunk reaches its last known token. A request whose sampling failed has no token
        but an entry in ``sample_errors`` (set anew by each call)."""
        self.sample_errors = {}
        ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqSlice] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        embed_rows: list[int] = []
        embed_parts: list[torch.Tensor] = []
        self._encoder_time = 0.0
        for chunk in plan.chunks:
            req = chunk.request
            q_start = len(ids)
            end = chunk.start + chunk.num_tokens
            ids.extend(req.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            seqs.append(SeqSlice(q_start, chunk.num_tokens, end, req.block_ids))
            if req.image_spans:
                self._image_embeds(req, chunk.start, end, q_start, embed_rows, embed_parts)
            if chunk.produces_token:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(req)
        dev = self.device
        meta = self.backend.prepare_metadata(seqs, self.block_size, dev)
        t0 = time.perf_counter()
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.backend,
            torch.tensor(embed_rows, dtype=torch.long, device=dev) if embed_rows else None,
            torch.cat(embed_parts) if embed_parts else None,
        )
        if not sample_rows:
            self._sync()
            self.last_forward_time = time.perf_counter() - t0 + self._encoder_time
            return {}
        if len(sample_rows) == len(ids):  # every row samples (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        self._sync()
        self.last_forward_time = time.perf_counter() - t0 + self._encoder_time
        if self.keep_logits:
            for r, row in zip(sample_reqs, logits.cpu(), strict=True):
                self.kept_logits.setdefault(r.request_id, []).append(row)
        tokens = self.sampler.sample(
            logits, [r.request_id for r in sample_reqs], [r.params for r in sample_reqs]
        )
        sampled: dict[str, int] = {}
        for r, t in zip(sample_reqs, tokens, strict=True):
            if isinstance(t, SampleFailure):
                self.sample_errors[r.request_id] = t.error
            else:
                sampled[r.request_id] = t
        return sampled

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _image_embeds(
        self,
        req: Request,
        start: int,
        end: int,
        q_start: int,
        rows: list[int],
        parts: list[torch.Tensor],
    ) -> None:
        """Scatter the embeddings of the image positions in [start, end) into the batch."""
        for idx, (span_start, n) in enumerate(req.image_spans):
            lo, hi = max(start, span_start), min(end, span_start + n)
            if lo >= hi:
                continue
            rows.extend(range(q_start + lo - start, q_start + hi - start))
            parts.append(self._image_tokens(req, idx, lo - span_start, hi - span_start))

    def _image_tokens(self, req: Request, idx: int, a: int, b: int) -> torch.Tensor:
        """Embeddings of tokens [a, b) of image ``idx``. The encoder runs only the bands those
        tokens lie in that no earlier chunk encoded (``req.image_embeds`` keeps each band until
        the request ends), so an image's encoder work is spread over its prefill chunks."""
        if self.vision is None:
            raise RuntimeError("this model has no vision encoder")
        if req.image_embeds is None:
            req.image_embeds = {}
        pixels = req.images[idx].pixels
        per = self.vision.band_tokens(int(pixels.shape[1]))
        first, last = a // per, (b - 1) // per + 1
        missing = [k for k in range(first, last) if (idx, k) not in req.image_embeds]
        if missing:
            lo, hi = missing[0], missing[-1] + 1
            t0 = time.perf_counter()
            image = torch.as_tensor(pixels, device=self.device)
            with torch.inference_mode():
                emb = self.vision.encode_bands(image, lo, hi).to(self.dtype)
            self._sync()
            self._encoder_time += time.perf_counter() - t0
            for k, band in zip(range(lo, hi), emb.split(per), strict=False):
                req.image_embeds.setdefault((idx, k), band)
        bands = [req.image_embeds[(idx, k)] for k in range(first, last)]
        return torch.cat(bands)[a - first * per : b - first * per]

    def release(self, req: Request) -> None:
        self.sampler.forget(req.request_id)
        req.image_embeds = None
