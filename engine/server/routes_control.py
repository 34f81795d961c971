"""Operations endpoints: health, models, Prometheus metrics, live scheduler GET/PUT."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.process.errors import APIError
from engine.server.auth import bearer_matches, digests
from engine.server.control import apply_scheduler_update
from engine.server.prepare import read_body
from engine.server.protocol import parse_json_body
from engine.server.state import ServerState
from wire.control import ControlRefused

logger = logging.getLogger(__name__)


def add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.client

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.client.alive
        body = {
            "status": "ok" if alive else "error",
            "step_loop_alive": alive,
            "engine_mode": state.client.mode,
            "model": state.model_name,
            "engine_id": state.engine_id,
            "uptime_s": round(time.time() - state.started, 3),
            "step_errors": state.client.num_step_errors,
            "last_error": state.client.last_error,
        }
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "chunkscope",
                    "max_model_len": int(engine.max_model_len),
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        with contextlib.suppress(Exception):
            state.metrics.refresh(engine.stats())
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/scheduler")
    async def get_scheduler() -> dict[str, Any]:
        return _scheduler_view(state)

    @app.put("/v1/scheduler")
    async def put_scheduler(request: Request) -> dict[str, Any]:
        _check_control_token(state, request)
        body = parse_json_body(await read_body(request, 64 * 1024))
        return await _apply_scheduler_update(state, body)


def _check_control_token(state: ServerState, request: Request) -> None:
    """Steering takes the control token; without one, the API key (when set) guards it too,
    so a server with only ``--api-key`` never leaves its scheduler open."""
    header = request.headers.get("authorization")
    if state.control_token is not None:
        if bearer_matches(header, digests([state.control_token])):
            return
        needed = "the server's --control-token"
    elif state.api_keys:
        if bearer_matches(header, state.api_keys):
            return
        needed = "the server's --api-key (it has no --control-token)"
    else:
        return
    raise APIError(
        401,
        f"changing the scheduler needs 'Authorization: Bearer <token>' with {needed}",
        type="authentication_error",
        code="invalid_control_token",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _scheduler_view(state: ServerState) -> dict[str, Any]:
    engine = state.client
    stats = engine.stats()
    return {
        "token_budget": engine.token_budget,
        "policy": engine.policy,
        "long_prefill_token_threshold": engine.long_prefill_token_threshold,
        "max_token_budget": engine.max_token_budget,
        "step": stats.step,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
    }


async def _apply_scheduler_update(state: ServerState, body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(
            400,
            'send a JSON object: {"token_budget": N}, {"policy": "chunked" | "unchunked"} '
            'and/or {"long_prefill_token_threshold": N}',
            code="invalid_value",
        )
    try:
        change = await apply_scheduler_update(state.client, body, source="api")
    except ControlRefused as exc:
        raise APIError(400, exc.reason, param=exc.param, code="invalid_value") from exc
    view = _scheduler_view(state)
    view.update(change.new)  # the values in force from applied_at_step on
    view["applied_at_step"] = change.applied_at_step
    view["changes"] = [e.to_dict() for e in change.events]
    return view
