"""The stall story's workload: the windows (a live scheduler change each), the chat and RAG
traffic, and one request as the client saw it."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Window:
    label: str
    changes: dict[str, Any]  # applied live at the window's start


def windows_of(spec: str) -> list[Window]:
    """``16384,512,256,unchunked``: a budget per window, or ``unchunked`` (the policy, at the
    budget before it)."""
    out = []
    for i, item in enumerate(s.strip() for s in spec.split(",")):
        if item == "unchunked":
            out.append(Window("unchunked", {"policy": "unchunked"}))
        else:
            changes: dict[str, Any] = {"token_budget": int(item)}
            if i == 0:
                changes["policy"] = "chunked"
            out.append(Window(item, changes))
    return out


@dataclass
class Traffic:
    """Closed-loop chat streams (a new request as soon as one ends) and RAG prompts on a fixed
    period whose lengths cycle evenly over [rag_min, rag_max] once per ``rag_cycle`` prompts (a
    window as long as a cycle sees every length, so windows are alike); every prompt is seeded
    random bytes after BOS (no prefix-cache hits)."""

    chat_streams: int
    chat_prompt: int
    chat_output: int
    rag_min: int
    rag_max: int
    rag_every: float
    rag_output: int
    seed: int
    rag_cycle: int = 1

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        n = max(1, self.rag_cycle)
        self.rag_lengths = [
            round(self.rag_max - (self.rag_max - self.rag_min) * i / max(1, n - 1))
            for i in range(n)
        ]
        self._num_rag = 0

    def prompt(self, n: int) -> list[int]:
        with self._lock:
            return [256] + [self._rng.randrange(256) for _ in range(n - 1)]

    def chat_prompt_ids(self) -> list[int]:
        return self.prompt(self.chat_prompt)

    def rag_prompt_ids(self) -> list[int]:
        with self._lock:
            n = self.rag_lengths[self._num_rag % len(self.rag_lengths)]
            self._num_rag += 1
        return self.prompt(n)


@dataclass
class ClientRequest:
    """One request as the client saw it (wall-clock seconds)."""

    traffic_class: str
    num_prompt_tokens: int
    sent: float
    chunk_times: list[float] = field(default_factory=list)
    engine_token_times: list[float] = field(default_factory=list)
    error: str | None = None
    # the server's own count (stream usage); an SSE chunk may carry several tokens when an
    # engine's frontend falls behind and merges deltas (vLLM's output collector does)
    completion_tokens: int | None = None
