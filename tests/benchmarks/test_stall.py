"""benchmarks/stall.py's bookkeeping, without an engine: windows, the RAG length cycle, which
window a token gap belongs to, the table of docs/benchmarks.md. No timing is asserted."""

from __future__ import annotations

import asyncio
import importlib
import json
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def stall() -> ModuleType:
    """The benchmark module (benchmarks/ is a package: no path edits)."""
    return importlib.import_module("benchmarks.stall")


def test_windows_spec(stall: ModuleType) -> None:
    ws = stall.windows_of("16384,512,unchunked")
    assert [w.label for w in ws] == ["16384", "512", "unchunked"]
    assert ws[0].changes == {"token_budget": 16384, "policy": "chunked"}
    assert ws[1].changes == {"token_budget": 512}
    assert ws[2].changes == {"policy": "unchunked"}


def test_rag_lengths_cycle_over_the_range(stall: ModuleType) -> None:
    t = stall.Traffic(1, 8, 4, 6000, 8000, 8.0, 4, seed=0, rag_cycle=3)
    lengths = [len(t.rag_prompt_ids()) for _ in range(6)]
    assert lengths == [8000, 7000, 6000, 8000, 7000, 6000]
    assert all(p[0] == 256 for p in (t.chat_prompt_ids(), t.rag_prompt_ids()))


def test_a_gap_belongs_to_the_window_of_its_first_token(stall: ModuleType) -> None:
    req = stall.ClientRequest("chat", 8, sent=0.5)
    req.chunk_times = [1.0, 1.01, 5.0, 5.01]  # a 4 s stall starting in the first window
    req.engine_token_times = [0.999, 1.009, 4.999, 5.009]
    rag = stall.ClientRequest("rag", 100, sent=0.2)
    rag.chunk_times = [4.9]
    rag.engine_token_times = [4.899]
    served = {"requests": [req, rag]}
    rows = stall.client_windows(served, [("a", 0.0, 3.0), ("b", 3.0, 10.0)])
    assert rows[0]["chat_itl_max_ms"] == pytest.approx(3990, abs=1)
    assert rows[1]["chat_itl_max_ms"] == pytest.approx(10, abs=1)
    assert rows[0]["rag_ttft_p50_ms"] == pytest.approx(4700, abs=1)
    assert rows[0]["output_tokens"] == 2 and rows[1]["output_tokens"] == 3
    assert rows[0]["delivery_max_ms"] == pytest.approx(1, abs=0.01)
    table = stall.markdown_table({"client": rows, "engine": rows})
    assert table.count("\n") == 3 and "budget a" in table
    targets = stall.targets(rows, rows)
    assert targets["client_b"]["max_itl_reduction"] == pytest.approx(399, rel=0.01)


class _FakeResponse:
    """An SSE body as aiohttp yields it: one ``bytes`` line at a time."""

    status = 200

    def __init__(self, lines: list[bytes]) -> None:
        self.content = self._lines(lines)

    @staticmethod
    async def _lines(lines: list[bytes]) -> Any:
        for line in lines:
            yield line

    async def __aenter__(self) -> _FakeResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _FakeSession:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def post(self, *args: Any, **kwargs: Any) -> _FakeResponse:
        return _FakeResponse(self.lines)


def test_a_stream_records_every_chunk_the_usage_and_the_engine_times() -> None:
    """Our engine's last chunk carries no choices, the usage and the ``chunkscope`` extension
    together (engine/server/responses.py): all three are read from it."""
    from benchmarks.stall_story.measure import stream_completion

    def data(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n"

    lines = [
        data({"choices": [{"text": "a"}]}),
        b"\n",
        data({"choices": [{"text": ""}]}),  # held-back bytes: still a token
        data({"choices": [], "usage": {"completion_tokens": 3},
              "chunkscope": {"token_times": [1.0, 2.0, 3.0]}}),
        b"data: [DONE]\n",
    ]  # fmt: skip
    rec = asyncio.run(stream_completion(_FakeSession(lines), "u", "m", [1, 2], 3, "chat"))
    assert rec.error is None
    assert len(rec.chunk_times) == 2
    assert rec.completion_tokens == 3
    assert rec.engine_token_times == [1.0, 2.0, 3.0]
