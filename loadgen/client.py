"""Send one streaming request and time it: TTFT, every inter-chunk gap, end-to-end.

Faults never raise: unreachable server, HTTP errors, malformed SSE, server error events and
streams cut before `[DONE]` are recorded on the request with a reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadgen.images import data_url
from loadgen.record import RequestRecord
from loadgen.spec import RequestSpec
from loadgen.sse import SSEError, SSEParser
from loadgen.tokens import TokenSource

logger = logging.getLogger(__name__)

ERROR_SNIPPET = 300


@dataclass
class ClientConfig:
    base_url: str
    model: str
    ignore_eos: bool = True
    prompt_format: str = "ids"  # "ids" | "text" (decided once, before the run)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    # Put the traffic class where vLLM passes it to its scheduler too (``vllm_xargs``, which
    # the chunkscope bridge stores): only for a vLLM server, since a strict OpenAI-compatible
    # one may refuse an unknown field. Set from /v1/models' ``owned_by`` by the run and sweep.
    vllm_xargs: bool = False


def build_body(spec: RequestSpec, cfg: ClientConfig, tokens: TokenSource) -> tuple[str, dict]:
    """(endpoint path, JSON body) for a request."""
    common: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.vllm_xargs:
        common["vllm_xargs"] = {"traffic_class": spec.traffic_class}
    if cfg.ignore_eos:
        common["ignore_eos"] = True
    if spec.is_chat:
        parts: list[dict[str, Any]] = [{"type": "text", "text": spec.text}]
        parts += [
            {"type": "image_url", "image_url": {"url": data_url(*img)}} for img in spec.images
        ]
        body = {**common, "messages": [{"role": "user", "content": parts}]}
        return "/v1/chat/completions", {**body, **cfg.extra_body}
    if cfg.prompt_format == "text":
        prompt: Any = tokens.text(spec.segments)
    else:
        prompt = tokens.tokens(spec.segments)
    return "/v1/completions", {**common, "prompt": prompt, **cfg.extra_body}


def is_output(choice: dict[str, Any]) -> bool:
    """Does this choice carry generated output? Text chunks count even when their text is empty
    (a detokenizer holding back a partial character); a chat delta that only announces the role
    (vLLM's first chunk) and an empty closing chunk with a finish_reason do not."""
    done = choice.get("finish_reason") is not None
    if "text" in choice:
        text = choice["text"]
        return isinstance(text, str) and (bool(text) or not done)
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning_content"):
        return True
    return "content" in delta and "role" not in delta and not done


class _Stream:
    """Per-request stream state; `handle` consumes one SSE event at perf time t.

    Output chunk times are kept raw and turned into TTFT / ITL once the stream ends."""

    def __init__(self, rec: RequestRecord, t_send: float) -> None:
        self.rec, self.t_send = rec, t_send
        self.done = False
        self.t_done: float | None = None
        self.times: list[float] = []  # perf times of output chunks
        self.other: list[float] = []  # choice chunks not counted (role-only, empty closing)

    def handle(self, data: str, event: str, t: float) -> bool:
        """False once the stream must stop (done or an error)."""
        rec = self.rec
        if data.strip() == "[DONE]":
            self.done, self.t_done = True, t
            return False
        rec.chunks += 1
        try:
            obj = json.loads(data)
        except ValueError:
            rec.fail(f"malformed SSE: invalid JSON in event {rec.chunks}: {data[:80]!r}")
            return False
        if not isinstance(obj, dict):
            rec.fail(f"malformed SSE: event {rec.chunks} is not a JSON object")
            return False
        if event == "error" or "error" in obj:
            err = obj.get("error", obj)
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.fail(f"server error event: {str(msg)[:ERROR_SNIPPET]}")
            return False
        choices = obj.get("choices")
        if choices and isinstance(choices, list) and isinstance(choices[0], dict):
            choice = choices[0]
            if choice.get("finish_reason"):
                rec.finish_reason = str(choice["finish_reason"])
            (self.times if is_output(choice) else self.other).append(t)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            rec.usage_present = True
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
        if isinstance(obj.get("chunkscope"), dict):
            rec.server = obj["chunkscope"]
        return True

    def finalize(self) -> None:
        """Fill TTFT, ITL and chunk wall times. chunkscope (recognised by its `chunkscope`
        block) sends one chunk per engine output, its first token in the role delta and its
        last in the closing chunk even when their text is still empty, so for it every choice
        chunk counts; vLLM and others announce the role before any token, so it does not."""
        rec = self.rec
        times = sorted(self.times + self.other) if rec.server is not None else self.times
        if not times or rec.send_wall is None:
            return
        rec.ttft_s = times[0] - self.t_send
        rec.itl_s = [b - a for a, b in zip(times, times[1:], strict=False)]
        rec.chunk_wall = [rec.send_wall + (t - self.t_send) for t in times]


@dataclass
class Prepared:
    path: str
    payload: bytes


def prepare(spec: RequestSpec, cfg: ClientConfig, tokens: TokenSource) -> Prepared:
    """Encode the request body (done before its send time so it does not delay the send)."""
    path, body = build_body(spec, cfg, tokens)
    return Prepared(path, json.dumps(body, separators=(",", ":")).encode())


async def send(
    session: aiohttp.ClientSession,
    spec: RequestSpec,
    prep: Prepared,
    rec: RequestRecord,
    cfg: ClientConfig,
    t0: float,
) -> None:
    """Run one request, filling `rec`; never raises except CancelledError (after recording)."""
    path, payload = prep.path, prep.payload
    rec.endpoint = path
    rec.prompt_format = "chat" if spec.is_chat else cfg.prompt_format
    rec.upload_bytes = len(payload)
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream",
        "X-Traffic-Class": spec.traffic_class,
    }
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
    t_send = time.perf_counter()
    rec.send_wall = time.time()
    rec.sent_s = t_send - t0
    rec.queue_s = rec.sent_s - spec.offset_s
    stream = _Stream(rec, t_send)
    try:
        async with session.post(
            cfg.base_url + path, data=payload, headers=headers, timeout=timeout
        ) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                text = (await resp.content.read(4096)).decode("utf-8", errors="replace")
                rec.fail(f"http {resp.status}: {' '.join(text.split())[:ERROR_SNIPPET]}")
                return
            parser = SSEParser()
            going = True
            async for chunk in resp.content.iter_any():
                t = time.perf_counter()
                for ev in parser.feed(chunk):
                    going = stream.handle(ev.data, ev.event, t)
                    if not going:
                        break
                if not going:
                    break
            if going:
                t = time.perf_counter()
                tail, clean = parser.flush()
                for ev in tail:
                    if not stream.handle(ev.data, ev.event, t):
                        break
                if not stream.done and rec.status != "error":
                    how = "" if clean else " (last event unterminated)"
                    rec.fail(f"stream cut: ended without [DONE]{how}")
    except asyncio.CancelledError:
        rec.fail("cancelled: run stopped before the request finished")
        raise
    except TimeoutError:
        rec.fail(f"timeout: no completion within {cfg.request_timeout_s:g} s")
    except aiohttp.ClientConnectorError as exc:
        rec.fail(f"connect error: {exc}")
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        rec.fail(f"stream cut: {type(exc).__name__}: {exc}")
    except SSEError as exc:
        rec.fail(f"malformed SSE: {exc}")
    except aiohttp.ClientError as exc:
        rec.fail(f"http client error: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - never crash the run on one request
        logger.exception("unexpected error on request %d", rec.index)
        rec.fail(f"client error: {type(exc).__name__}: {exc}")
    finally:
        _finish(rec, stream, t_send)


def _finish(rec: RequestRecord, stream: _Stream, t_send: float) -> None:
    stream.finalize()
    end = stream.t_done if stream.t_done is not None else time.perf_counter()
    rec.e2e_s = end - t_send  # to [DONE] (end of response), or to the failure
    if stream.done and rec.status == "pending":
        rec.status = "ok"
    if rec.output_tokens is None and rec.chunk_wall:
        rec.output_tokens = len(rec.chunk_wall)  # usage missing: fall back to counted chunks
    if rec.status == "ok" and rec.ttft_s is None:
        rec.fail("no output: stream finished without any text chunk")
    if rec.ttft_s is not None and rec.output_tokens and rec.output_tokens > 1:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
