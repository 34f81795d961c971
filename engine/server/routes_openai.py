"""The OpenAI endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

A body of ``OFF_LOOP_BYTES`` or more (up to ``--max-body-bytes``, 32 MiB by default) is parsed,
its images decoded and its prompt tokenized in a worker thread, so ``/health``, ``/metrics`` and
the token streams of other requests keep flowing while it is prepared; small bodies are prepared
inline (a thread hop would cost more than the work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from engine.process.errors import APIError
from engine.server.chat import render_chat
from engine.server.generation import GenerationRunner
from engine.server.prepare import (
    check_model,
    load_chat_images,
    read_body,
    resolve_max_tokens,
    sampling_params,
)
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_traffic_class,
    parse_request,
)
from engine.server.responses import (
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
    stream_response,
)
from engine.server.state import ServerState

T = TypeVar("T")
OFF_LOOP_BYTES = 64 * 1024


async def _prepared(off_loop: bool, fn: Callable[[], T]) -> T:
    return await run_in_threadpool(fn) if off_loop else fn()


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.client
    runner = GenerationRunner(state)

    def _prompt_ids(req: CompletionRequest) -> list[int]:
        prompt = req.prompt_text_or_ids
        if isinstance(prompt, str):
            return list(engine.tokenizer.encode(prompt, add_bos=True))
        ids = list(prompt)
        vocab = int(engine.tokenizer.vocab_size)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {bad} in prompt is outside the vocabulary (0..{vocab - 1})",
                param="prompt",
                code="invalid_value",
            )
        return ids

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        body = await read_body(request, state.max_body_bytes)

        def prepare() -> tuple[CompletionRequest, list[int]]:
            req = parse_request(CompletionRequest, body)
            check_model(state, req.model)
            return req, _prompt_ids(req)

        req, ids = await _prepared(len(body) >= OFF_LOOP_BYTES, prepare)
        max_tokens = resolve_max_tokens(state, req.max_tokens, len(ids), "prompt")
        params = sampling_params(state, req, max_tokens)
        gen, deltas = await runner.submit(
            request, ids, params, stops=req.stop_list, traffic_class=traffic_class
        )
        if req.stream:
            return stream_response(completion_chunks(state.model_name, req, gen, deltas))
        return JSONResponse(await completion_body(state.model_name, gen, deltas))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        body = await read_body(request, state.max_body_bytes)
        big = len(body) >= OFF_LOOP_BYTES
        req = await _prepared(big, lambda: parse_request(ChatCompletionRequest, body))
        check_model(state, req.model)

        def prepare() -> tuple[list[int], list[Any]]:
            turns, images = load_chat_images(state, req)
            try:
                return render_chat(turns, engine.tokenizer), images
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages", code="invalid_value") from exc

        ids, images = await _prepared(big or bool(req.num_images), prepare)
        max_tokens = resolve_max_tokens(state, req.requested_max_tokens, len(ids), "messages")
        params = sampling_params(state, req, max_tokens)
        gen, deltas = await runner.submit(
            request, ids, params, stops=req.stop_list, traffic_class=traffic_class, images=images
        )
        if req.stream:
            return stream_response(chat_chunks(state.model_name, req, gen, deltas))
        return JSONResponse(await chat_body(state.model_name, gen, deltas))
