"""Step cost model: a step's time as a linear function of its work. No torch.

A step runs one forward over every chunk it scheduled. Its time is modelled as

    t = c0 + c_prefill * P + c_decode * D + c_attn * A + c_attn_decode * Ad + c_vision * I
        + c_multi_row * M

where ``P`` is the number of prefill tokens, ``D`` the number of decode tokens and ``A`` the
attention pairs: for each chunk of ``n`` new tokens starting at position ``s``, every new token
attends to its context, so the chunk adds ``n * s + n * (n + 1) / 2`` (query, key) pairs::

    positions   0 ........ s-1 | s ... s+n-1
                 cached context | new tokens (causal among themselves)
    pairs       n * s           + 1 + 2 + ... + n

``Ad`` is the decode chunks' share of ``A`` (a decode token's pairs are its context): a decode
token reads its context from the cache slot by slot, a prefill chunk runs one kernel over
contiguous keys, so a decode pair costs ``c_attn + c_attn_decode`` (both kept non-negative).
``I`` is the image placeholder tokens among the step's prefill tokens: the vision encoder runs
on the bands of an image its chunk reaches (``engine/model/runner.py``), work the language
model's terms do not count. ``M`` is 1 for a step of more than one token row and 0 for a lone
decode: on the CPU engine a one-row step runs its linear layers as matrix-vector products, and
measured (issue 19a, demo preset, one thread) a lone decode took 6.4 ms, two decodes 11 ms, four
13 ms: without ``M`` the fit's per-decode cost came out at 3 ms and steps of 4-16 decodes at
other budgets 1.3-1.9x too long.

Fitted by ordinary least squares (numpy), it is the instrument's reference for what a step
should cost: a served step much slower than its prediction is time the engine did not spend
computing. ``fit`` reports its own error, so a user can judge it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

FEATURES = (
    "const",
    "prefill_tokens",
    "decode_tokens",
    "attention_pairs",
    "decode_pairs",
    "image_tokens",
    "multi_row",
)


def chunk_pairs(start: int, num_tokens: int) -> int:
    """(query, key) pairs of one chunk: ``num_tokens`` new tokens after ``start`` cached ones."""
    if start < 0 or num_tokens < 0:
        raise ValueError(f"start and num_tokens must be >= 0, got {start}, {num_tokens}")
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepWork:
    prefill_tokens: int
    decode_tokens: int
    attention_pairs: int  # every chunk's, decode included
    # the decode chunks' share of ``attention_pairs``: a decode token reads its whole context
    # from the cache (gathered slot by slot on CPU), a prefill chunk runs one attention kernel
    # over contiguous keys, so a decode pair costs more than a prefill pair (issue 19: without
    # it, decode steps of long-context requests came out 10-24% off the fit at other budgets)
    decode_pairs: int = 0
    # image placeholder tokens among the prefill tokens: the vision encoder's work (issue 19a:
    # without it, prefill steps of image requests took 1.2-1.3x a fit pinned by text prompts)
    image_tokens: int = 0

    @classmethod
    def from_chunks(
        cls,
        chunks: Iterable[Mapping[str, Any] | Any],
        image_share: Mapping[str, float] | None = None,
    ) -> StepWork:
        """From chunk records (dicts or objects with ``kind``, ``start``, ``num_tokens`` and,
        with ``image_share``, ``request_id``). ``image_share``: per request, the share of its
        prompt that is image placeholders; a prefill chunk of ``n`` tokens of such a request
        counts ``round(n * share)`` image tokens (where in the prompt the image lies is not
        known from the store, so the fit counts them the same way)."""
        prefill = decode = pairs = decode_pairs = 0
        image = 0.0
        for c in chunks:
            if isinstance(c, Mapping):
                n, s, kind = int(c["num_tokens"]), int(c["start"]), c.get("kind")
            else:  # a scheduler's chunk (the simulator: every step it predicts)
                n, s, kind = int(c.num_tokens), int(c.start), c.kind
            p = chunk_pairs(s, n)
            if kind == "decode":
                decode += n
                decode_pairs += p
            else:
                prefill += n
                if image_share:
                    rid = c.get("request_id") if isinstance(c, Mapping) else c.request_id
                    image += n * image_share.get(str(rid), 0.0)
            pairs += p
        return cls(prefill, decode, pairs, decode_pairs, round(image))

    def row(self) -> list[float]:
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.decode_tokens),
            float(self.attention_pairs),
            float(self.decode_pairs),
            float(self.image_tokens),
            1.0 if self.prefill_tokens + self.decode_tokens >= 2 else 0.0,
        ]


@dataclass(frozen=True)
class CostModel:
    """Seconds per step = ``const + prefill*P + decode*D + attn*A + attn_decode*Ad + vision*I
    + multi_row*M`` (``M``: the step has more than one token row)."""

    const: float
    prefill: float
    decode: float
    attn: float
    # what a decode pair costs beyond ``attn`` (0 in a model fitted before the term existed,
    # which then predicts as it did)
    attn_decode: float = 0.0
    # seconds per image token (the vision encoder; 0 in a model fitted before the term existed)
    vision: float = 0.0
    # seconds a step of more than one row costs beyond a lone decode (0 in an older model)
    multi_row: float = 0.0
    # how well it fits the steps it was fitted on: relative error |pred - t| / t
    num_steps: int = 0
    rel_err_p50: float = 0.0
    rel_err_p95: float = 0.0
    r2: float = 0.0

    def predict(self, work: StepWork) -> float:
        return (
            self.const
            + self.prefill * work.prefill_tokens
            + self.decode * work.decode_tokens
            + self.attn * work.attention_pairs
            + self.attn_decode * work.decode_pairs
            + self.vision * work.image_tokens
            + (self.multi_row if work.prefill_tokens + work.decode_tokens >= 2 else 0.0)
        )

    def predict_many(self, works: Sequence[StepWork]) -> np.ndarray:
        x = np.array([w.row() for w in works], dtype=np.float64).reshape(-1, len(FEATURES))
        return x @ self.coefficients()

    def coefficients(self) -> np.ndarray:
        """The coefficients in ``FEATURES`` order."""
        return np.array(
            [
                self.const,
                self.prefill,
                self.decode,
                self.attn,
                self.attn_decode,
                self.vision,
                self.multi_row,
            ]
        )

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def fit(
    works: Sequence[StepWork],
    seconds: Sequence[float],
    *,
    weights: Sequence[float] | None = None,
) -> CostModel:
    """Least-squares fit of the step cost model to measured step times.

    ``weights`` (one per step, positive) makes it weighted least squares: each step's squared
    residual counts ``weight**2`` times; ``1 / seconds`` solves for the least *relative* error,
    so a 5 ms decode step counts as much as a 500 ms prefill step. The reported errors are
    always the plain ones.

    Coefficients are kept non-negative (a negative cost per token is an artefact of noise or of
    a feature the steps never varied): a coefficient that comes out negative is fixed at zero and
    the others refitted.
    """
    if len(works) != len(seconds):
        raise ValueError(f"{len(works)} steps but {len(seconds)} times")
    x = np.array([w.row() for w in works], dtype=np.float64).reshape(-1, len(FEATURES))
    y = np.asarray(seconds, dtype=np.float64)
    if not np.all(np.isfinite(y)) or np.any(y < 0):
        raise ValueError("step times must be finite and non-negative")
    need = max(1 + int(np.sum(np.ptp(x[:, 1:], axis=0) > 0)), 5)
    if len(works) < need:
        raise ValueError(f"need at least {need} steps to fit the cost model")
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != y.shape or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be one finite positive number per step")
    xw, yw = x * w[:, None], y * w
    # a feature that never varies is the constant's to carry (a column of ones beside it, or
    # of zeros: image tokens in a window without images, a multi-row step in every step)
    active = [i for i in range(x.shape[1]) if i == 0 or np.ptp(x[:, i]) > 0]
    coef = np.zeros(x.shape[1])
    while True:
        # scale columns so that tokens (~1e3) and pairs (~1e7) are solved with equal care
        cols = xw[:, active]
        scale = np.where(np.abs(cols).max(axis=0) > 0, np.abs(cols).max(axis=0), 1.0)
        sol, *_ = np.linalg.lstsq(cols / scale, yw, rcond=None)
        sol = sol / scale
        negative = [a for a, v in zip(active, sol, strict=True) if v < 0 and a != 0]
        if not negative:
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [a for a in active if a not in negative]
    pred = x @ coef
    rel = np.abs(pred - y) / np.maximum(y, 1e-9)
    ss_res = float(np.sum((y - pred) ** 2))
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return CostModel(
        const=float(coef[0]),
        prefill=float(coef[1]),
        decode=float(coef[2]),
        attn=float(coef[3]),
        attn_decode=float(coef[4]),
        vision=float(coef[5]),
        multi_row=float(coef[6]),
        num_steps=len(y),
        rel_err_p50=float(np.percentile(rel, 50)),
        rel_err_p95=float(np.percentile(rel, 95)),
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
    )
