"""Running the app under uvicorn: a listening socket, and a server on a background thread."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from engine.core.config import EngineConfig
from engine.process.client import EngineClient
from engine.server.app import build_app
from engine.server.state import ServerState


@dataclass
class ServerHandle:
    """A server running on a background thread (tests, benchmarks); ``stop()`` also stops its
    engine core."""

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


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: FastAPI, log_level: str) -> Any:
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

    ``engine`` is an ``EngineConfig`` (the engine core starts in a child process, as under
    ``python -m engine``), an ``EngineClient``, or an ``LLMEngine`` (its core loop runs on a
    thread of this process, so a test can inspect or patch the engine). ``port=0`` picks a free
    port; the returned handle has ``base_url``, ``state`` and ``stop()``.
    """
    if isinstance(engine, EngineConfig):
        client = EngineClient.spawn(engine)
    elif isinstance(engine, EngineClient):
        client = engine
    else:
        client = EngineClient.in_thread(engine)
    try:
        return _serve(client, host, port, log_level, startup_timeout, app_options)
    except BaseException:
        client.shutdown()
        raise


def _serve(
    engine: EngineClient,
    host: str,
    port: int,
    log_level: str,
    startup_timeout: float,
    app_options: dict[str, Any],
) -> ServerHandle:
    app = build_app(engine, **app_options)
    sock = bind_socket(host, port)
    real_port = int(sock.getsockname()[1])
    server = uvicorn_server(app, log_level)
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
