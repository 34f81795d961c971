"""Operations endpoints: health, models, Prometheus metrics, live scheduler GET/PUT."""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.protocol import APIError, SchedulerUpdate, parse_request
from engine.serving.prepare import read_body
from engine.serving.state import ServerState

logger = logging.getLogger(__name__)


def add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.loop.alive
        body = {
            "status": "ok" if alive else "error",
            "step_loop_alive": alive,
            "engine_mode": state.loop.mode,
            "model": state.model_name,
            "engine_id": state.engine_id,
            "uptime_s": round(time.time() - state.started, 3),
            "step_errors": state.loop.num_step_errors,
            "last_error": state.loop.last_error,
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
        update = parse_request(SchedulerUpdate, await read_body(request, 64 * 1024))
        return _apply_scheduler_update(state, update)


def _check_control_token(state: ServerState, request: Request) -> None:
    if state.control_token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), state.control_token.encode()
    ):
        raise APIError(
            401,
            "changing the scheduler needs 'Authorization: Bearer <token>' with the server's "
            "--control-token",
            type="authentication_error",
            code="invalid_control_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _scheduler_view(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    stats = engine.stats()
    return {
        "token_budget": engine.token_budget,
        "policy": engine.policy,
        "max_token_budget": engine.max_token_budget,
        "step": stats.step,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_total": stats.kv_blocks_total,
    }


def _apply_scheduler_update(state: ServerState, update: SchedulerUpdate) -> dict[str, Any]:
    from engine.config import POLICIES

    engine = state.engine
    if update.token_budget is None and update.policy is None:
        raise APIError(
            400,
            'send {"token_budget": N} and/or {"policy": "chunked" | "unchunked"}',
            code="invalid_value",
        )
    # Check both before applying either, so a bad pair changes nothing.
    if update.token_budget is not None and not 1 <= update.token_budget <= engine.max_token_budget:
        raise APIError(
            400,
            f"token_budget must be from 1 to max_token_budget ({engine.max_token_budget}), "
            f"got {update.token_budget}",
            param="token_budget",
            code="invalid_value",
        )
    if update.policy is not None and update.policy not in POLICIES:
        raise APIError(
            400,
            f"policy must be one of {list(POLICIES)}, got {update.policy!r}",
            param="policy",
            code="invalid_value",
        )
    changes = []
    if update.token_budget is not None:
        changes.append(engine.set_token_budget(update.token_budget, source="api"))
    if update.policy is not None:
        changes.append(engine.set_policy(update.policy, source="api"))
    refused = [c for c in changes if not c.accepted]
    if refused:
        c = refused[0]
        raise APIError(
            400, f"{c.key} change refused: {c.reason}", param=c.key, code="change_refused"
        )
    applied = [c.applied_at_step for c in changes if c.applied_at_step is not None]
    view = _scheduler_view(state)
    for c in changes:  # the values that will be in force at applied_at_step
        view[c.key] = c.new_value
    view["applied_at_step"] = max(applied) if applied else None
    view["changes"] = [c.to_dict() for c in changes]
    logger.info("scheduler update: %s", view["changes"])
    return view
