"""The OpenAI-compatible HTTP server: FastAPI app, step-loop thread, and the ``engine`` CLI.

One thread runs ``engine.step()`` in a loop; HTTP handlers only queue requests into the engine
(thread-safe) and read their outputs from per-request asyncio queues that the step thread fills
with ``loop.call_soon_threadsafe``. So HTTP handling never blocks a step, and a step never waits
on a client.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.chat import ChatInputError, render_chat, turns_from_messages
from engine.metrics import EngineMetrics
from engine.multimodal import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageError,
    load_image_input,
)
from engine.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SchedulerUpdate,
    check_traffic_class,
    error_body,
    parse_request,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
READY_LINE = "chunkscope engine listening on http://{host}:{port}"
_SSE_DONE = b"data: [DONE]\n\n"


# --- incremental detokenization and stop strings -------------------------------------------


class IncrementalDetokenizer:
    """Turn token ids into text as they arrive, holding back incomplete UTF-8 / merges.

    The window trick from vLLM: decode ``ids[prefix:]`` and ``ids[prefix:read]`` and emit the
    difference, unless the new text ends in U+FFFD (a multi-byte character still arriving).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # Byte-level tokenizers: an incremental UTF-8 decoder is exact and much cheaper.
        self._bytes = getattr(tokenizer, "decode_bytes", None)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, new_ids: list[int]) -> str:
        if self._bytes is not None:
            return str(self._utf8.decode(self._bytes(new_ids)))
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        if self._bytes is not None:
            return str(self._utf8.decode(b"", final=True))
        return self._delta(final=True)

    def _delta(self, *, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read])
        new_text = self._tok.decode(self.ids[self._prefix :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""
        if new_text.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return new_text[len(prefix_text) :]


class TextAccumulator:
    """Output text so far; finds stop strings and holds back text that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        search_from = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [i for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def take(self, *, final: bool) -> str:
        end = len(self.text) if (final or self.stopped) else max(0, len(self.text) - self._hold)
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


# --- the step loop ------------------------------------------------------------------------


class RequestFailed(RuntimeError):
    """The engine failed while serving this request."""


@dataclass
class _Stream:
    queue: asyncio.Queue[Any]
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    """Runs ``engine.step()`` on its own thread and routes outputs to per-request queues."""

    def __init__(self, engine: Any, *, idle_wait: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait = idle_wait
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._running = False
        self._thread: threading.Thread | None = None
        self._abort_pending = threading.Event()
        self.last_error: str | None = None
        self.num_step_errors = 0
        self.last_step_time: float | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.alive:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="chunkscope-step-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self._deliver(stream, RequestFailed(f"server shutting down; request {rid} stopped"))

    # request side (event loop thread) ------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: list[int],
        params: Any,
        *,
        traffic_class: str | None,
        images: list[Any] | None,
    ) -> tuple[str, asyncio.Queue[Any]]:
        """Queue a request in the engine; raises ValueError / QueueFullError untouched."""
        if not self.alive:
            raise APIError(
                503,
                "the engine step loop is not running; see /health and the server log",
                type="server_error",
                code="engine_dead",
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = _Stream(queue=asyncio.Queue(), loop=asyncio.get_running_loop())
        with self._lock:
            self._streams[rid] = stream
        try:
            self.engine.add_request(
                prompt_token_ids,
                params,
                request_id=rid,
                traffic_class=traffic_class,
                images=images or None,
                arrival_time=time.time(),
            )
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
            raise
        return rid, stream.queue

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)
        self._abort_pending.set()

    # engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        logger.info("step loop started")
        while self._running:
            try:
                if not engine.has_unfinished_requests() and not self._abort_pending.is_set():
                    engine.wait_for_work(self.idle_wait)
                    continue
                self._abort_pending.clear()
                result = engine.step()
                self.last_step_time = time.time()
            except Exception as exc:  # the loop never dies: fail what was in flight, go on
                self._on_step_error(exc)
                continue
            if result.outputs:
                self._dispatch(result.outputs)
        logger.info("step loop stopped")

    def _dispatch(self, outputs: list[Any]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        with self._lock:
            for out in outputs:
                stream = (
                    self._streams.pop(out.request_id, None)
                    if out.finished
                    else self._streams.get(out.request_id)
                )
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # loop closed: server shutting down
                loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, stream: _Stream, item: Any) -> None:
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _on_step_error(self, exc: Exception) -> None:
        self.num_step_errors += 1
        self.last_error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.error("engine step failed:\n%s", traceback.format_exc())
        rid = getattr(exc, "request_id", None)
        with self._lock:
            if rid is not None and rid in self._streams:
                victims = {rid: self._streams.pop(rid)}
            else:  # not attributable: fail everything in flight so the engine can recover
                victims, self._streams = self._streams, {}
        for victim_id, stream in victims.items():
            self._deliver(stream, RequestFailed(f"engine step failed: {self.last_error}"))
            with contextlib.suppress(Exception):
                self.engine.abort_request(victim_id)
        if not victims:
            time.sleep(self.idle_wait)  # avoid a hot error loop


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


# --- generation (shared by completions and chat) --------------------------------------------


@dataclass
class Delta:
    text: str
    finished: bool
    finish_reason: str | None
    num_new_tokens: int


@dataclass
class Generation:
    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_image_tokens: int = 0
    num_cached_tokens: int = 0
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
        }
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def extension(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "first_scheduled_time": self.first_scheduled_time,
            "token_times": self.token_times,
            "num_image_tokens": self.num_image_tokens,
        }


class Session:
    """Everything one HTTP request needs from the server state."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def generate(
        self,
        gen: Generation,
        queue: asyncio.Queue[Any],
        stops: list[str],
    ) -> AsyncIterator[Delta]:
        """Yield text deltas until the request finishes; abort the engine request on exit."""
        detok = IncrementalDetokenizer(self.state.engine.tokenizer)
        acc = TextAccumulator(stops)
        done = False
        try:
            while not done:
                out = await queue.get()
                if isinstance(out, Exception):
                    done = True
                    raise out
                if getattr(out, "error", None):
                    done = True
                    raise RequestFailed(f"the engine failed this request: {out.error}")
                gen.num_output_tokens = out.num_output_tokens
                gen.num_image_tokens = out.num_image_tokens
                gen.num_cached_tokens = out.num_cached_tokens
                gen.num_prompt_tokens = out.num_prompt_tokens
                gen.arrival_time = out.arrival_time
                gen.first_scheduled_time = out.first_scheduled_time
                gen.token_times.extend(out.token_times)
                acc.add(detok.add(list(out.new_token_ids)))
                if out.finished:
                    acc.add(detok.flush())
                if acc.stopped and not out.finished:
                    self.state.loop.abort(gen.request_id)
                    done = True
                    gen.finish_reason = "stop"
                elif out.finished:
                    done = True
                    gen.finish_reason = "stop" if acc.stopped else out.finish_reason
                text = acc.take(final=done)
                gen.text = acc.text[: acc.emitted]
                yield Delta(text, done, gen.finish_reason, len(out.new_token_ids))
        finally:
            if not done:  # client went away (or the handler failed): free the KV blocks now
                logger.info("request %s cancelled before finishing; aborting", gen.request_id)
                self.state.loop.abort(gen.request_id)


@dataclass
class ServerState:
    engine: Any
    loop: EngineLoop
    metrics: EngineMetrics
    model_name: str
    engine_id: str
    control_token: str | None = None
    collector_url: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    started: float = field(default_factory=time.time)


# --- request preparation --------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"request body is {size} bytes, over the {limit} byte limit; send smaller images or "
        "a shorter prompt (the limit is the server's --max-body-bytes)",
        code="request_too_large",
    )


def _check_model(state: ServerState, model: str | None) -> None:
    if model is None or model in (state.model_name, state.engine.config.model):
        return
    raise APIError(
        400,
        f"model {model!r} is not served here; this server serves {state.model_name!r} "
        "(see GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def _resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_len: int, prompt_param: str
) -> int:
    max_len = int(state.engine.max_model_len)
    if prompt_len >= max_len:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens, but this model's context is {max_len} tokens "
            "(prompt plus output); shorten the prompt",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_len - prompt_len
    if prompt_len + requested > max_len:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens and max_tokens is {requested}, together more "
            f"than this model's context of {max_len} tokens; lower max_tokens to at most "
            f"{max_len - prompt_len} or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> Any:
    from engine.sampling_params import SamplingParams

    try:
        return SamplingParams(**req.sampling_kwargs(max_tokens))
    except (TypeError, ValueError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _submit(
    state: ServerState,
    prompt: list[int],
    params: Any,
    traffic_class: str | None,
    images: list[Any] | None,
) -> tuple[str, asyncio.Queue[Any]]:
    from engine.llm_engine import QueueFullError

    try:
        return state.loop.submit(prompt, params, traffic_class=traffic_class, images=images)
    except QueueFullError as exc:
        raise APIError(
            503,
            f"the engine's waiting queue is full ({exc}); retry shortly",
            type="server_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from exc
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# --- the app --------------------------------------------------------------------------------


def build_app(
    engine: Any,
    *,
    control_token: str | None = None,
    collector_url: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    engine_id: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the step-loop thread."""
    model_name = str(engine.model_name)
    eid = (
        engine_id
        or getattr(engine, "engine_id", None)
        or engine.config.engine_id
        or f"{socket.gethostname()}-{os.getpid()}"
    )
    metrics = EngineMetrics(model_name, eid)
    engine.add_listener(metrics.on_event)
    state = ServerState(
        engine=engine,
        loop=EngineLoop(engine),
        metrics=metrics,
        model_name=model_name,
        engine_id=eid,
        control_token=control_token or None,
        collector_url=collector_url,
        max_body_bytes=max_body_bytes,
        max_image_bytes=max_image_bytes,
        max_image_pixels=max_image_pixels,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="chunkscope engine", lifespan=lifespan)
    app.state.server = state
    _install_error_handlers(app)
    _add_routes(app, state)
    return app


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine
    session = Session(state)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = state.loop.alive
        body = {
            "status": "ok" if alive else "error",
            "step_loop_alive": alive,
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        req = parse_request(CompletionRequest, await read_body(request, state.max_body_bytes))
        _check_model(state, req.model)
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
        max_tokens = _resolve_max_tokens(state, req.max_tokens, len(ids), "prompt")
        params = _sampling_params(req, max_tokens)
        rid, queue = _submit(state, ids, params, traffic_class, None)
        gen = Generation(request_id=rid, num_prompt_tokens=len(ids))
        deltas = session.generate(gen, queue, req.stop_list)
        if req.stream:
            return _stream_response(_completion_chunks(state, req, gen, deltas))
        return JSONResponse(await _completion_body(state, gen, _until_disconnect(request, deltas)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        traffic_class = check_traffic_class(request.headers.get("x-traffic-class"))
        req = parse_request(ChatCompletionRequest, await read_body(request, state.max_body_bytes))
        _check_model(state, req.model)
        if req.num_images:
            turns, images = await run_in_threadpool(_load_chat_images, state, req)
        else:
            turns, images = _load_chat_images(state, req)
        try:
            ids = render_chat(turns, engine.tokenizer)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        max_tokens = _resolve_max_tokens(state, req.requested_max_tokens, len(ids), "messages")
        params = _sampling_params(req, max_tokens)
        rid, queue = _submit(state, ids, params, traffic_class, images)
        gen = Generation(request_id=rid, num_prompt_tokens=len(ids))
        deltas = session.generate(gen, queue, req.stop_list)
        if req.stream:
            return _stream_response(_chat_chunks(state, req, gen, deltas))
        return JSONResponse(await _chat_body(state, gen, _until_disconnect(request, deltas)))


def _load_chat_images(state: ServerState, req: ChatCompletionRequest) -> tuple[list, list]:
    cap = int(state.engine.config.image_token_cap)

    def load(url: str) -> Any:
        return load_image_input(
            url,
            token_cap=cap,
            max_bytes=state.max_image_bytes,
            max_pixels=state.max_image_pixels,
        )

    try:
        return turns_from_messages(req.messages, load)
    except ChatInputError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_image") from exc
    except ImageError as exc:
        raise APIError(400, str(exc), param="messages", code="invalid_image") from exc


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


# --- response shaping -----------------------------------------------------------------------


def _stream_response(chunks: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        chunks,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _error_chunk(exc: Exception) -> bytes:
    return _sse(error_body(str(exc), type="server_error", code="engine_error"))


_TEXT_MARK = "\u0000TEXT\u0000"
_REASON_MARK = "\u0000REASON\u0000"


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


async def _completion_chunks(
    state: ServerState, req: CompletionRequest, gen: Generation, deltas: AsyncIterator[Delta]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": gen.request_id, "object": "text_completion", "created": created}
    base["model"] = state.model_name
    template = _ChunkTemplate(base, {"index": 0, "text": _TEXT_MARK, "logprobs": None})
    try:
        async for d in deltas:
            yield template.render(d.text, d.finish_reason)
    except RequestFailed as exc:
        yield _error_chunk(exc)
        yield _SSE_DONE
        return
    if req.include_usage:
        yield _sse({**base, "choices": [], "usage": gen.usage(), "chunkscope": gen.extension()})
    yield _SSE_DONE


async def _chat_chunks(
    state: ServerState, req: ChatCompletionRequest, gen: Generation, deltas: AsyncIterator[Delta]
) -> AsyncIterator[bytes]:
    created = int(time.time())
    base = {"id": f"chat{gen.request_id}", "object": "chat.completion.chunk", "created": created}
    base["model"] = state.model_name
    template = _ChunkTemplate(
        base, {"index": 0, "delta": {"content": _TEXT_MARK}, "logprobs": None}
    )
    first = True
    try:
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
    except RequestFailed as exc:
        yield _error_chunk(exc)
        yield _SSE_DONE
        return
    if req.include_usage:
        yield _sse({**base, "choices": [], "usage": gen.usage(), "chunkscope": gen.extension()})
    yield _SSE_DONE


class ClientGone(Exception):
    """The client of a non-streaming request closed its connection."""


async def _until_disconnect(request: Request, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """Pass ``deltas`` through; stop (and so abort the request) if the client disconnects.

    The body has been read already, so the next ASGI message is ``http.disconnect``.
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        while True:
            step = asyncio.ensure_future(anext(deltas))
            done, _ = await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
                raise ClientGone()
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        watcher.cancel()
        await deltas.aclose()  # type: ignore[attr-defined]


async def _drain(gen: Generation, deltas: AsyncIterator[Delta]) -> None:
    try:
        async for _ in deltas:
            pass
    except ClientGone as exc:
        logger.info("client of %s disconnected; request aborted", gen.request_id)
        raise APIError(400, "client disconnected", code="client_disconnected") from exc
    except RequestFailed as exc:
        raise APIError(500, str(exc), type="server_error", code="engine_error") from exc


async def _completion_body(
    state: ServerState, gen: Generation, deltas: AsyncIterator[Delta]
) -> dict[str, Any]:
    await _drain(gen, deltas)
    return {
        "id": gen.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [
            {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
        ],
        "usage": gen.usage(),
        "chunkscope": gen.extension(),
    }


async def _chat_body(
    state: ServerState, gen: Generation, deltas: AsyncIterator[Delta]
) -> dict[str, Any]:
    await _drain(gen, deltas)
    return {
        "id": f"chat{gen.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
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


# --- running it -----------------------------------------------------------------------------


@dataclass
class ServerHandle:
    """A server running on a background thread (tests, benchmarks)."""

    base_url: str
    host: str
    port: int
    app: FastAPI
    server: Any
    thread: threading.Thread

    @property
    def state(self) -> ServerState:
        return self.app.state.server  # type: ignore[no-any-return]

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: FastAPI, log_level: str) -> Any:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        ws="none",
    )
    return uvicorn.Server(config)


def serve_in_thread(
    engine: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout: float = 30.0,
    **app_options: Any,
) -> ServerHandle:
    """Build the app for ``engine`` and serve it from a background thread on ``host:port``.

    ``port=0`` picks a free port; the returned handle has ``base_url`` and ``stop()``.
    """
    app = build_app(engine, **app_options)
    sock = _bind(host, port)
    real_port = int(sock.getsockname()[1])
    server = _uvicorn_server(app, log_level)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="chunkscope-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the HTTP server did not start; see the log")
        time.sleep(0.02)
    url = f"http://{host}:{real_port}"
    return ServerHandle(url, host, real_port, app, server, thread)


# --- CLI ------------------------------------------------------------------------------------


_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--model", {"default": "tiny", "help": "preset name (tiny, demo, llama3-8b, ...) or a "
                 "local Hugging Face model folder"}),
    ("--host", {"default": "127.0.0.1", "help": "address to listen on (0.0.0.0: all)"}),
    ("--port", {"type": int, "default": 8000, "help": "port to listen on; 0 picks a free one"}),
    ("--token-budget", {"type": int, "default": 512,
                        "help": "tokens one step may schedule (change live: PUT /v1/scheduler)"}),
    ("--max-token-budget", {"type": int, "default": 8192,
                            "help": "highest token budget a live change may set"}),
    ("--policy", {"choices": ("chunked", "unchunked"), "default": "chunked",
                  "help": "chunked splits long prompts across steps; unchunked prefills a "
                  "prompt in one step"}),
    ("--max-model-len", {"type": int, "default": None,
                         "help": "context length, prompt plus output (default: the model's)"}),
    ("--block-size", {"type": int, "default": 16, "help": "tokens per KV cache block"}),
    ("--max-num-seqs", {"type": int, "default": 256, "help": "most requests running at once"}),
    ("--max-waiting", {"type": int, "default": 1024,
                       "help": "most requests waiting; more get 503 with Retry-After"}),
    ("--no-prefix-caching", {"action": "store_true", "help": "turn off prefix caching"}),
    ("--device", {"choices": ("auto", "cpu", "cuda"), "default": "auto",
                  "help": "where the model runs"}),
    ("--dtype", {"choices": ("auto", "float32", "bfloat16", "float16"), "default": "auto",
                 "help": "model dtype"}),
    ("--attention-backend", {"choices": ("auto", "sdpa", "flash"), "default": "auto",
                             "help": "attention kernel"}),
    ("--seed", {"type": int, "default": 0, "help": "seed for synthetic weights and sampling"}),
    ("--image-token-cap", {"type": int, "default": 1280,
                           "help": "most image tokens per image (one per 28x28 pixels after "
                           "resizing)"}),
    ("--engine-id", {"default": None,
                     "help": "name of this engine in metrics and events (default: HOST-PID)"}),
    ("--collector-url", {"default": None,
                         "help": "telemetry collector to stream events to; accepted and "
                         "stored now, used once the telemetry collector lands"}),
    ("--control-token", {"default": None,
                         "help": "bearer token that PUT /v1/scheduler requires; falls back to "
                         "$CHUNKSCOPE_CONTROL_TOKEN (keeps it out of ps); neither: no token"}),
    ("--max-body-bytes", {"type": int, "default": DEFAULT_MAX_BODY_BYTES,
                          "help": "largest request body accepted; larger gets 413"}),
    ("--max-image-bytes", {"type": int, "default": DEFAULT_MAX_IMAGE_BYTES,
                           "help": "largest encoded image accepted; larger gets 400"}),
    ("--log-level", {"default": "info", "choices": ("debug", "info", "warning", "error"),
                     "help": "log level"}),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine",
        description="Serve a chunked-prefill engine behind an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models, /v1/scheduler, /metrics, /health).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for flag, kwargs in _FLAGS:
        p.add_argument(flag, **kwargs)
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-blocks", type=int, default=None, help="number of KV cache blocks")
    kv.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=None,
        help="fraction of device memory for the KV cache (GPU), instead of --kv-blocks",
    )
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        token_budget=args.token_budget,
        max_token_budget=args.max_token_budget,
        policy=args.policy,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.kv_blocks,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        seed=args.seed,
        engine_id=args.engine_id,
        image_token_cap=args.image_token_cap,
    ).validate()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except (OSError, ValueError) as exc:
        print(f"chunkscope engine: cannot start: {exc}", file=sys.stderr)
        return 2
    app = build_app(
        engine,
        control_token=args.control_token or os.environ.get("CHUNKSCOPE_CONTROL_TOKEN"),
        collector_url=args.collector_url,
        max_body_bytes=args.max_body_bytes,
        max_image_bytes=args.max_image_bytes,
        engine_id=args.engine_id,
    )
    try:
        sock = _bind(args.host, args.port)
    except OSError as exc:
        print(
            f"chunkscope engine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 2
    port = int(sock.getsockname()[1])
    server = _uvicorn_server(app, "warning" if args.log_level != "debug" else "debug")
    _announce_when_started(server, READY_LINE.format(host=args.host, port=port))
    server.run(sockets=[sock])
    return 0


def _announce_when_started(server: Any, line: str) -> None:
    def watch() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            print(line, file=sys.stderr, flush=True)

    threading.Thread(target=watch, name="chunkscope-ready", daemon=True).start()


__all__: list[str] = [
    "EngineLoop",
    "IncrementalDetokenizer",
    "ServerHandle",
    "TextAccumulator",
    "build_app",
    "build_parser",
    "main",
    "serve_in_thread",
]
