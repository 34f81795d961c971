"""OpenAI response shapes: SSE chunk streams and whole bodies for completions and chat."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from engine.process.errors import APIError, error_body
from engine.process.streams import RequestFailed
from engine.server.generation import ClientGone, Delta, Generation
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

_SSE_DONE = b"data: [DONE]\n\n"
_TEXT_MARK = "\u0000TEXT\u0000"
_REASON_MARK = "\u0000REASON\u0000"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error_chunk(exc: Exception) -> bytes:
    return _sse(error_body(str(exc), type="server_error", code="engine_error"))


class _ChunkTemplate:
    """An SSE chunk pre-encoded around its varying text and finish_reason: cheap per token.

    ``choice`` holds ``_TEXT_MARK`` where the text goes.
    """

    def __init__(self, base: dict[str, Any], choice: dict[str, Any]) -> None:
        doc = {**base, "choices": [{**choice, "finish_reason": _REASON_MARK}]}
        raw = json.dumps(doc, separators=(",", ":"))
        head, rest = raw.split(json.dumps(_TEXT_MARK), 1)
        mid, tail = rest.split(json.dumps(_REASON_MARK), 1)
        self._head = b"data: " + head.encode()
        self._mid = mid.encode()
        self._tail = tail.encode() + b"\n\n"

    def render(self, text: str, finish_reason: str | None) -> bytes:
        return b"".join(
            (
                self._head,
                json.dumps(text).encode(),
                self._mid,
                b"null" if finish_reason is None else json.dumps(finish_reason).encode(),
                self._tail,
            )
        )


def stream_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def completion_chunks(
    model_name: str, req: CompletionRequest, gen: Generation, deltas: AsyncIterator[Delta]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": gen.request_id, "object": "text_completion", "created": created}
    base["model"] = model_name
    template = _ChunkTemplate(base, {"index": 0, "text": _TEXT_MARK, "logprobs": None})

    async def chunks() -> AsyncIterator[bytes]:
        async for d in deltas:
            yield template.render(d.text, d.finish_reason)

    async for chunk in _framed(base, req.include_usage, gen, chunks()):
        yield chunk


async def chat_chunks(
    model_name: str, req: ChatCompletionRequest, gen: Generation, deltas: AsyncIterator[Delta]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": f"chat{gen.request_id}", "object": "chat.completion.chunk", "created": created}
    base["model"] = model_name
    template = _ChunkTemplate(
        base, {"index": 0, "delta": {"content": _TEXT_MARK}, "logprobs": None}
    )

    async def chunks() -> AsyncIterator[bytes]:
        first = True
        async for d in deltas:
            if first or (d.finished and not d.text):
                delta: dict[str, Any] = {"content": d.text} if (d.text or not d.finished) else {}
                if first:
                    delta = {"role": "assistant", "content": d.text}
                    first = False
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": d.finish_reason,
                }
                yield _sse({**base, "choices": [choice]})
            else:
                yield template.render(d.text, d.finish_reason)

    async for chunk in _framed(base, req.include_usage, gen, chunks()):
        yield chunk


async def _framed(
    base: dict[str, Any], include_usage: bool, gen: Generation, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """The token chunks, then the usage chunk (when asked for) and ``[DONE]``; an engine error
    becomes an error chunk; a client that left gets nothing more (its request is aborted)."""
    try:
        async for chunk in chunks:
            yield chunk
    except ClientGone:
        return
    except RequestFailed as exc:
        yield _error_chunk(exc)
        yield _SSE_DONE
        return
    if include_usage:
        yield _sse({**base, "choices": [], "usage": gen.usage(), "chunkscope": gen.extension()})
    yield _SSE_DONE


async def _drain(deltas: AsyncIterator[Delta]) -> None:
    try:
        async for _ in deltas:
            pass
    except ClientGone as exc:
        raise APIError(400, "client disconnected", code="client_disconnected") from exc
    except RequestFailed as exc:
        raise APIError(500, str(exc), type="server_error", code="engine_error") from exc


async def completion_body(
    model_name: str, gen: Generation, deltas: AsyncIterator[Delta]
) -> dict[str, Any]:
    await _drain(deltas)
    return {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
        ],
        "usage": gen.usage(),
        "chunkscope": gen.extension(),
    }


async def chat_body(
    model_name: str, gen: Generation, deltas: AsyncIterator[Delta]
) -> dict[str, Any]:
    await _drain(deltas)
    return {
        "id": f"chat{gen.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
            }
        ],
        "usage": gen.usage(),
        "chunkscope": gen.extension(),
    }
