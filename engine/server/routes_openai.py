"""The OpenAI endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions``."""

from __future__ import annotations

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


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.client
    runner = GenerationRunner(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        req = parse_request(CompletionRequest, await read_body(request, state.max_body_bytes))
        check_model(state, req.model)
        prompt = req.prompt_text_or_ids
        if isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt, add_bos=True)
        else:
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
        max_tokens = resolve_max_tokens(state, req.max_tokens, len(ids), "prompt")
        params = sampling_params(req, max_tokens)
        gen, deltas = await runner.submit(
            request, ids, params, stops=req.stop_list, traffic_class=traffic_class
        )
        if req.stream:
            return stream_response(completion_chunks(state.model_name, req, gen, deltas))
        return JSONResponse(await completion_body(state.model_name, gen, deltas))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        req = parse_request(ChatCompletionRequest, await read_body(request, state.max_body_bytes))
        check_model(state, req.model)
        if req.num_images:
            turns, images = await run_in_threadpool(load_chat_images, state, req)
        else:
            turns, images = load_chat_images(state, req)
        try:
            ids = render_chat(turns, engine.tokenizer)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        max_tokens = resolve_max_tokens(state, req.requested_max_tokens, len(ids), "messages")
        params = sampling_params(req, max_tokens)
        gen, deltas = await runner.submit(
            request, ids, params, stops=req.stop_list, traffic_class=traffic_class, images=images
        )
        if req.stream:
            return stream_response(chat_chunks(state.model_name, req, gen, deltas))
        return JSONResponse(await chat_body(state.model_name, gen, deltas))
