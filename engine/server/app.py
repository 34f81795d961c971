"""The FastAPI app: server state, routes, OpenAI-shaped errors, engine-core shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.process.client import EngineClient
from engine.process.errors import APIError, error_body
from engine.server.auth import APIKeyMiddleware, digests
from engine.server.metrics import EngineMetrics
from engine.server.multimodal import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS
from engine.server.routes_control import add_control_routes
from engine.server.routes_openai import add_openai_routes
from engine.server.state import (
    DEFAULT_LIMIT_IMAGES_PER_PROMPT,
    DEFAULT_MAX_BODY_BYTES,
    ServerState,
)

logger = logging.getLogger(__name__)


def build_app(
    engine: Any,
    *,
    control_token: str | None = None,
    api_keys: Sequence[str] = (),
    collector_url: str | None = None,
    collector_token: str | None = None,
    telemetry_spill_dir: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    engine_id: str | None = None,
    limit_images_per_prompt: int = DEFAULT_LIMIT_IMAGES_PER_PROMPT,
) -> FastAPI:
    """The FastAPI app serving ``engine``; its shutdown stops the engine core.

    ``engine`` is an ``EngineClient`` (``EngineClient.spawn(config)``: the core in a child
    process, the default) or an ``LLMEngine``, whose core loop then runs on a thread of this
    process (``EngineClient.in_thread``).
    """
    client = engine if isinstance(engine, EngineClient) else EngineClient.in_thread(engine)
    model_name = str(client.model_name)
    eid = (
        engine_id
        or client.engine_id
        or client.config.engine_id
        or f"{socket.gethostname()}-{os.getpid()}"
    )
    metrics = EngineMetrics(model_name, eid)
    client.add_listener(metrics.on_event)
    state = ServerState(
        client=client,
        metrics=metrics,
        model_name=model_name,
        engine_id=eid,
        control_token=control_token or None,
        api_keys=digests(api_keys),
        collector_url=collector_url,
        max_body_bytes=max_body_bytes,
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
        limit_images_per_prompt=limit_images_per_prompt,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from engine.server.publishing import start_for_state

        publisher = start_for_state(state, token=collector_token, spill_dir=telemetry_spill_dir)
        try:
            yield
        finally:
            await asyncio.to_thread(client.shutdown)
            if publisher is not None:  # after the core: its last events, then the goodbye
                await asyncio.to_thread(publisher.close)

    app = FastAPI(title="chunkscope engine", lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    if state.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=state.api_keys)
    add_control_routes(app, state)
    add_openai_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            error_body(message, type=kind, code=str(exc.status_code)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal server error: {exc}", type="server_error", code="internal"),
            status_code=500,
        )
