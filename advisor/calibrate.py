"""A short calibration of the step cost on a served engine: prompts of a few lengths prefilled
one at a time at each token budget, so the store holds long prefill steps of every chunk size.

A traffic window at one budget holds a dozen long prefill steps at best (issue 19: a 45 s window
of chat with 15% RAG, 4 RAG prompts), all of that budget's chunk size, and the fit carries their
cost to the other budgets. A calibration runs the chunk sizes the prediction is about, against
contexts up to the longest prompt, on the engine itself: its steps are ordinary steps in the
store (stamped by the engine, stored by the collector), selected by the calibration's time span
and fitted together with the traffic window's (``advisor.fit.fit_from_store``, ``extra``).

Each request is a fresh random prompt (no prefix cache hit), ``max_tokens`` 1, sent only when
the one before it has finished: the engine runs nothing else meanwhile, so each step is one
prefill chunk. Through the engine's control API (``PUT /v1/scheduler``, the control token when
the engine has one); the budget it had is restored at the end. Plain HTTP (urllib), no torch.
"""

from __future__ import annotations

import json
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# prompt lengths (tokens) run at every budget: a chunk of each size against short and long
# contexts (a 3,900-token prompt at budget 128 is 31 chunks with contexts 0 to 3,840)
PROMPT_TOKENS = (600, 1900, 3900)
REPEATS = 2
# then this many short requests at once, each decoding DECODE_TOKENS tokens: decode steps of
# every batch size up to the largest (a traffic window at one budget holds the batch sizes its
# queue made; at a smaller budget prefill is slower, more streams overlap, and steps of 7-16
# decodes were predicted 1.4-1.7x too long from a window of 1-6: issue 19a)
DECODE_BATCHES = (4, 8, 16)
DECODE_TOKENS = 32
DECODE_PROMPT_TOKENS = 48
TOKEN_RANGE = (10, 250)  # ids drawn from here (inside every preset's vocabulary: 260 bytes)


class CalibrationError(RuntimeError):
    """The engine refused a calibration request or a budget change."""


@dataclass(frozen=True)
class Calibration:
    """What a calibration ran and when (wall seconds): the span whose steps the fit adds."""

    since: float
    until: float
    budgets: list[int]
    prompt_tokens: list[int]
    repeats: int
    requests: int
    seconds_per_budget: dict[str, float] = field(default_factory=dict)
    decode_batches: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def _call(
    url: str, method: str, body: dict[str, Any] | None, token: str | None, timeout: float
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    req.add_header("X-Traffic-Class", "calibration")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read().decode() or "{}")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        raise CalibrationError(f"{method} {url}: http {exc.code}: {detail}") from exc
    return out if isinstance(out, dict) else {}


def calibrate(
    base_url: str,
    budgets: Sequence[int],
    *,
    prompt_tokens: Sequence[int] = PROMPT_TOKENS,
    repeats: int = REPEATS,
    control_token: str | None = None,
    model: str | None = None,
    seed: int = 0,
    timeout_s: float = 120.0,
    max_model_len: int | None = None,
    decode_batches: Sequence[int] = DECODE_BATCHES,
) -> Calibration:
    """Prefill ``repeats`` fresh prompts of each length in ``prompt_tokens`` at each budget of
        ``budgets`` (ascending), one request at a time, on the engine at ``base_url``; the budget
        is restored afterwards. Prompts are cut to ``max_model_len`` less two tokens (when given);
    budgets above the engine's ``max_token_budget`` are skipped. Then, at the engine's own
    budget, each of ``decode_batches`` short requests sent at once (decode steps of that many
    sequences, fewer as they finish)."""
    base = base_url.rstrip("/")
    view = _call(base + "/v1/scheduler", "GET", None, None, timeout_s)
    before = int(view["token_budget"])
    if model is None:
        models = _call(base + "/v1/models", "GET", None, None, timeout_s)
        model = str((models.get("data") or [{}])[0].get("id", "default"))
    max_len = int(max_model_len or 1 << 30)
    top = int(view.get("max_token_budget") or 1 << 30)
    budgets = [int(b) for b in budgets if 0 < int(b) <= top]
    rng = random.Random(seed)
    lo, hi = TOKEN_RANGE
    t0 = time.time()
    per_budget: dict[str, float] = {}
    n = 0
    try:
        for b in sorted({int(x) for x in budgets}):
            _call(base + "/v1/scheduler", "PUT", {"token_budget": b}, control_token, timeout_s)
            tb = time.perf_counter()
            for _ in range(repeats):
                for length in prompt_tokens:
                    length = max(1, min(int(length), max_len - 2))
                    prompt = [rng.randrange(lo, hi) for _ in range(length)]
                    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": False}
                    body["ignore_eos"] = True
                    _call(base + "/v1/completions", "POST", body, None, timeout_s)
                    n += 1
            per_budget[str(b)] = time.perf_counter() - tb
        _call(base + "/v1/scheduler", "PUT", {"token_budget": before}, control_token, timeout_s)
        for size in decode_batches:
            prompts = [
                [rng.randrange(lo, hi) for _ in range(DECODE_PROMPT_TOKENS)] for _ in range(size)
            ]
            bodies = [
                {
                    "model": model,
                    "prompt": p,
                    "max_tokens": DECODE_TOKENS,
                    "stream": False,
                    "ignore_eos": True,
                }
                for p in prompts
            ]
            with ThreadPoolExecutor(max_workers=max(1, size)) as pool:
                futures = [
                    pool.submit(_call, base + "/v1/completions", "POST", b, None, timeout_s)
                    for b in bodies
                ]
                for f in futures:
                    f.result()
            n += size
    finally:
        _call(base + "/v1/scheduler", "PUT", {"token_budget": before}, control_token, timeout_s)
    cal = Calibration(
        since=t0,
        until=time.time(),
        budgets=sorted({int(x) for x in budgets}),
        prompt_tokens=[int(x) for x in prompt_tokens],
        repeats=repeats,
        requests=n,
        decode_batches=[int(x) for x in decode_batches],
        seconds_per_budget=per_budget,
    )
    logger.info(
        "calibration: %d prompts at budgets %s in %.1f s",
        n,
        cal.budgets,
        cal.until - cal.since,
    )
    return cal
