"""A fast mock OpenAI-compatible streaming server for tests and the overhead benchmark.

Streams `max_tokens` one-character chunks on a fixed schedule (first after `ttft_ms`, then one
every `interval_ms`) and reports the wall-clock send time of each chunk in a final
`chunkscope`-style block (`token_times`), so client timings can be checked against it. Faults
are chosen per request by the `X-Mock-Fault` header (or for all requests by `--fault`):
http500, reject_ids (400 on token-id prompts), malformed (invalid JSON), error_event, cut
(connection dropped mid-stream), no_done (clean end without [DONE]), no_usage.

Run: `python -m loadgen.mockserver --port 0` prints `mock listening on http://127.0.0.1:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)


@dataclass
class MockConfig:
    ttft_ms: float = 5.0
    interval_ms: float = 5.0
    max_model_len: int = 32768
    fault: str = ""
    max_chunks: int = 100_000


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SEEN = web.AppKey("seen", list)  # requests received, for tests


def make_app(cfg: MockConfig) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    seen: list[dict[str, Any]] = []
    app[SEEN] = seen

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "mock", "max_model_len": cfg.max_model_len}]}
        )

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def complete(req: web.Request) -> web.StreamResponse:
        arrival = time.time()
        body = await req.json()
        fault = req.headers.get("X-Mock-Fault", cfg.fault)
        chat = req.path.endswith("/chat/completions")
        seen.append({"path": req.path, "class": req.headers.get("X-Traffic-Class"), "body": body})
        if fault == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if fault == "reject_ids" and isinstance(body.get("prompt"), list):
            return web.json_response({"error": {"message": "token ids not accepted"}}, status=400)
        n = max(1, min(int(body.get("max_tokens") or 16), cfg.max_chunks))
        prompt_len = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 10
        if not body.get("stream"):
            return web.json_response(
                {
                    "choices": [{"text": "x" * n, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": prompt_len, "completion_tokens": n},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        start = time.perf_counter()
        times: list[float] = []
        wall0 = time.time() - (time.perf_counter() - start)
        for k in range(n):
            due = start + (cfg.ttft_ms + k * cfg.interval_ms) / 1000.0
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if fault == "cut" and k == n // 2:
                assert req.transport is not None
                req.transport.close()
                return resp
            if fault == "malformed" and k == n // 2:
                await resp.write(b"data: {not json\n\n")
                continue
            if fault == "error_event" and k == n // 2:
                await resp.write(_sse({"error": {"message": "engine overloaded"}}))
                continue
            delta = {"role": "assistant", "content": "x"} if k == 0 else {"content": "x"}
            choice = (
                {"index": 0, "delta": delta, "finish_reason": None}
                if chat
                else {"index": 0, "text": "x", "finish_reason": None}
            )
            times.append(time.time())
            await resp.write(_sse({"choices": [choice]}))
        final: dict[str, Any] = {
            "choices": [],
            "chunkscope": {
                "request_id": f"mock-{len(seen)}",
                "arrival_time": arrival,
                "first_scheduled_time": arrival,
                "token_times": times,
                "due_times": [  # the schedule, to tell server lateness from client error
                    wall0 + (cfg.ttft_ms + k * cfg.interval_ms) / 1000.0 for k in range(len(times))
                ],
            },
        }
        if fault != "no_usage":
            final["usage"] = {
                "prompt_tokens": prompt_len,
                "completion_tokens": n,
                "total_tokens": prompt_len + n,
            }
        await resp.write(_sse(final))
        if fault != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    return app


async def serve(cfg: MockConfig, host: str = "127.0.0.1", port: int = 0) -> None:
    runner = web.AppRunner(make_app(cfg), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    sys.stderr.write(f"mock listening on http://{host}:{sock.getsockname()[1]}\n")
    sys.stderr.flush()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadgen.mockserver", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft-ms", type=float, default=5.0)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--fault", default="")
    a = p.parse_args(argv)
    cfg = MockConfig(a.ttft_ms, a.interval_ms, a.max_model_len, a.fault)
    try:
        asyncio.run(serve(cfg, port=a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
