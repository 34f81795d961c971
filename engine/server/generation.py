"""One request's life: submit it to the engine, turn its outputs into text deltas, and abort it
the moment its client goes away (shared by completions and chat, streaming or not)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from engine.core.admission import QueueFullError
from engine.process.errors import APIError
from engine.process.streams import ADMITTED, RequestFailed, RequestRefused, engine_dead
from engine.server.detokenize import IncrementalDetokenizer, TextAccumulator
from engine.server.state import ServerState

logger = logging.getLogger(__name__)
OBSERVED_WAIT_S = 10.0


class ClientGone(Exception):
    """The client closed its connection before its request finished."""


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


class GenerationRunner:
    """Submits HTTP requests to the engine core and turns their outputs into text deltas."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def submit(
        self,
        request: Request,
        prompt: list[int],
        params: Any,
        *,
        stops: list[str],
        traffic_class: str | None,
        images: list[Any] | None = None,
    ) -> tuple[Generation, AsyncIterator[Delta]]:
        """Queue the request in the engine core and wait until the core admitted it; return
        its record and its text deltas. A refusal raises the APIError for it (503 with
        Retry-After for a full queue, 400 for an invalid request) before any response starts.

        From submission on a task watches the connection, so a client that goes away is aborted
        at once, whether or not the deltas are ever iterated (a stream whose first chunk never
        went out) and whatever the ASGI server does about disconnects.
        """
        client = self.state.client
        try:
            rid, queue = client.submit(prompt, params, traffic_class=traffic_class, images=images)
        except QueueFullError as exc:
            raise _queue_full(str(exc)) from exc
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        watcher = asyncio.ensure_future(self._abort_on_disconnect(request, rid, queue))
        try:
            first = await queue.get()
        except BaseException:
            watcher.cancel()
            client.abort(rid)
            raise
        if first is not ADMITTED:
            watcher.cancel()
            raise _refusal_error(first)
        gen = Generation(request_id=rid, num_prompt_tokens=len(prompt))
        return gen, self._deltas(gen, queue, stops, watcher)

    async def _abort_on_disconnect(
        self, request: Request, request_id: str, queue: asyncio.Queue[Any]
    ) -> None:
        """The body has been read already, so the next ASGI message is ``http.disconnect``."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        logger.info("client of %s disconnected; request aborted", request_id)
        self.state.client.abort(request_id)
        queue.put_nowait(ClientGone())  # wakes the consumer, if there is one

    async def _deltas(
        self,
        gen: Generation,
        queue: asyncio.Queue[Any],
        stops: list[str],
        watcher: asyncio.Future[None],
    ) -> AsyncIterator[Delta]:
        """Yield text deltas until the request finishes; abort the engine request on exit.

        Raises ``ClientGone`` when the client disconnects, ``RequestFailed`` when the engine
        fails the request or its output cannot be detokenized (the engine request is then
        aborted).
        """
        detok = IncrementalDetokenizer(self.state.client.tokenizer)
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
                try:
                    acc.add(detok.add(list(out.new_token_ids)))
                    if out.finished:
                        acc.add(detok.flush())
                except Exception as exc:  # noqa: BLE001 - this request fails, not the server
                    logger.exception("detokenizing request %s failed", gen.request_id)
                    raise RequestFailed(
                        f"detokenizing the output failed: {type(exc).__name__}: {exc}"
                    ) from exc
                if acc.stopped and not out.finished:
                    self.state.client.abort(gen.request_id, reason="stop")
                    done = True
                    gen.finish_reason = "stop"
                elif out.finished:
                    done = True
                    gen.finish_reason = "stop" if acc.stopped else out.finish_reason
                text = acc.take(final=done)
                gen.text = acc.text[: acc.emitted]
                yield Delta(text, done, gen.finish_reason, len(out.new_token_ids))
            if out.finished:
                # the last token has gone out; the response ends once the engine client's
                # listeners have seen the step that finished the request (its events counted)
                await _observed(queue)
        finally:
            watcher.cancel()
            if not done:  # the consumer stopped early (a failed send, a cancelled handler)
                logger.info("request %s cancelled before finishing; aborting", gen.request_id)
                self.state.client.abort(gen.request_id)


async def _observed(queue: asyncio.Queue[Any]) -> None:
    """Wait for the item after a request's last output: ``OBSERVED``, or whatever ends the
    stream instead (the engine failing, the client gone); a bound keeps a response from
    waiting on it forever."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(queue.get(), OBSERVED_WAIT_S)


def _queue_full(detail: str) -> APIError:
    return APIError(
        503,
        f"the engine's waiting queue is full ({detail}); retry shortly",
        type="server_error",
        code="queue_full",
        headers={"Retry-After": "1"},
    )


def _refusal_error(item: object) -> BaseException:
    """The error for what came instead of ``ADMITTED``: a refusal, a dead engine, a client
    that left."""
    if isinstance(item, RequestRefused):
        if item.kind == "queue_full":
            return _queue_full(item.message)
        if item.kind == "invalid":
            return APIError(400, item.message, code="invalid_value")
        return APIError(500, item.message, type="server_error", code="engine_error")
    if isinstance(item, RequestFailed):
        return engine_dead(str(item))
    if isinstance(item, ClientGone):
        return APIError(400, "client disconnected", code="client_disconnected")
    return RuntimeError(f"unexpected first item {item!r} in a request queue")
