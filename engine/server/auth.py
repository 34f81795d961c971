"""The engine's API key, the way vLLM's ``--api-key`` works: every ``/v1`` route needs
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open (probes and Prometheus
scrape without it), and so does ``OPTIONS``. ``PUT /v1/scheduler`` is steering, not serving: it
takes the control token (``routes_control``), and the API key only when no control token is set.

Keys are compared as SHA-256 digests in constant time, every key each time (as vLLM does), so
neither a key's length nor which key matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

GUARDED_PREFIX = "/v1"


def digests(keys: Sequence[str]) -> tuple[bytes, ...]:
    """SHA-256 of each key's UTF-8 bytes (what a client sends for a non-ASCII key)."""
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys if k)


def bearer_matches(authorization: str | None, keys: tuple[bytes, ...]) -> bool:
    """True when the ``Authorization`` header is ``Bearer <one of keys>``."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = given.strip()
    try:  # ASGI servers hand header bytes over decoded as latin-1: these are the bytes sent
        raw = given.encode("latin-1")
    except UnicodeEncodeError:
        raw = given.encode()
    digest = hashlib.sha256(raw).digest()
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(digest, key)
    return ok


_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "this server needs 'Authorization: Bearer <key>' with its --api-key "
            "(or $CHUNKSCOPE_API_KEY)",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class APIKeyMiddleware:
    """Pure ASGI (no per-chunk cost on streams): refuses unauthenticated ``/v1`` requests."""

    def __init__(self, app: ASGIApp, keys: tuple[bytes, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            steering = path == "/v1/scheduler" and scope.get("method") == "PUT"
            if (
                path.startswith(GUARDED_PREFIX)
                and not steering
                and not bearer_matches(Headers(scope=scope).get("authorization"), self.keys)
            ):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": _UNAUTHORIZED})
                return
        await self.app(scope, receive, send)
