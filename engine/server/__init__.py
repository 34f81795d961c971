"""The OpenAI-compatible HTTP server (``python -m engine``), one job per module.

``core`` is the engine core: an ``LLMEngine`` and its step loop, driven by commands over a
channel. ``transport`` says where the core runs: a child process behind two pipes (the default)
or a thread behind two in-process queues (tests, embedding). ``client`` is the server's one handle
on it (request checks, a writer and a reader thread, event listeners, control round trips) and
``streams`` routes each request's outputs to its asyncio queue. ``generation`` consumes one
request's queue (text deltas, stop strings, aborts on disconnect); ``routes_openai`` /
``routes_control`` are the endpoints, ``control`` the one implementation of a live scheduler
change; ``app`` wires them into FastAPI, ``serve`` runs the app on a background thread and
``cli`` is ``python -m engine``.
"""

from __future__ import annotations

from engine.process.client import EngineClient, EngineStartError
from engine.process.streams import RequestFailed, RequestRefused
from engine.server.app import build_app
from engine.server.cli import build_parser, config_from_args, main
from engine.server.control import SchedulerChange, apply_scheduler_update
from engine.server.detokenize import IncrementalDetokenizer, TextAccumulator
from engine.server.serve import ServerHandle, serve_in_thread
from engine.server.state import DEFAULT_MAX_BODY_BYTES, ServerState

__all__: list[str] = [
    "DEFAULT_MAX_BODY_BYTES",
    "EngineClient",
    "EngineStartError",
    "IncrementalDetokenizer",
    "RequestFailed",
    "RequestRefused",
    "SchedulerChange",
    "ServerHandle",
    "ServerState",
    "TextAccumulator",
    "apply_scheduler_update",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
    "serve_in_thread",
]
