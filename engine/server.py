"""The OpenAI-compatible HTTP server's public entry (``python -m engine``, tests, benchmarks).

The implementation lives in ``engine.serving``, one job per module; see its docstring.
"""

from __future__ import annotations

from engine.serving.app import build_app
from engine.serving.cli import READY_LINE, build_parser, config_from_args, main
from engine.serving.detokenize import IncrementalDetokenizer, TextAccumulator
from engine.serving.engine_loop import EngineLoop, RequestFailed
from engine.serving.serve import ServerHandle, serve_in_thread
from engine.serving.state import DEFAULT_MAX_BODY_BYTES, ServerState

__all__: list[str] = [
    "DEFAULT_MAX_BODY_BYTES",
    "READY_LINE",
    "EngineLoop",
    "IncrementalDetokenizer",
    "RequestFailed",
    "ServerHandle",
    "ServerState",
    "TextAccumulator",
    "build_app",
    "build_parser",
    "config_from_args",
    "main",
    "serve_in_thread",
]
