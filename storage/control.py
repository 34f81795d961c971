"""The one control client for the collector's ``/control`` path (docs/telemetry.md): used by
``python -m storage control`` / ``engines`` and by the dashboard (``dashboard/control.py`` adds
only its UI's checks and wording). Synchronous (websockets' sync client), so it works from a
Streamlit script thread and from inside a running event loop alike; every exchange is bounded
by a timeout."""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

_ids = itertools.count(1)


class CollectorUnavailable(ConnectionError):
    """The collector did not answer (down, wrong address, or too slow)."""


def control_url(collector_url: str, auth_token: str | None = None) -> str:
    """``ws://host:port`` (or ``.../ingest``) -> ``ws://host:port/control`` (``?token=`` with
    the collector's ``--auth-token``)."""
    parts = urlsplit(collector_url.strip())
    if parts.scheme not in ("ws", "wss") or not parts.netloc:
        raise ValueError(f"collector URL must look like ws://HOST:PORT, got {collector_url!r}")
    query = "token=" + quote(auth_token, safe="") if auth_token is not None else ""
    return urlunsplit((parts.scheme, parts.netloc, "/control", query, ""))


def exchange(
    collector_url: str,
    message: dict[str, Any],
    want: str,
    msg_id: str | None = None,
    *,
    auth_token: str | None = None,
    timeout: float = 20.0,
) -> dict[str, Any]:
    """Send ``message`` and return the first reply of type ``want`` (with id ``msg_id`` when
    given), or the collector's ``error`` reply; ``CollectorUnavailable`` when it cannot be
    reached or does not answer within ``timeout`` seconds."""
    from websockets.exceptions import WebSocketException
    from websockets.sync.client import connect

    # The token goes in an Authorization header (kept out of URLs that proxies log); a token
    # that is not ASCII cannot be a header value, so it goes as ?token= instead.
    in_header = auth_token is not None and auth_token.isascii()
    url = control_url(collector_url, None if in_header else auth_token)
    headers = {"Authorization": f"Bearer {auth_token}"} if in_header else None
    shown = control_url(collector_url)  # never the auth token in a message
    deadline = time.monotonic() + timeout
    try:
        with connect(
            url, open_timeout=timeout, proxy=None, close_timeout=1, additional_headers=headers
        ) as ws:
            ws.send(json.dumps(message, allow_nan=False))
            while True:
                reply = json.loads(ws.recv(timeout=max(0.0, deadline - time.monotonic())))
                if not isinstance(reply, dict):
                    continue
                if reply.get("type") == "error":
                    return reply
                if reply.get("type") == want and (msg_id is None or reply.get("id") == msg_id):
                    return reply
    except TimeoutError as exc:
        raise CollectorUnavailable(
            f"no answer from the collector at {shown} in {timeout:g} s"
        ) from exc
    except (OSError, WebSocketException, json.JSONDecodeError) as exc:
        raise CollectorUnavailable(f"collector at {shown} unreachable: {exc}") from exc


def list_engines(
    url: str, *, auth_token: str | None = None, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """The engines the collector has seen since it started, connected or not."""
    reply = exchange(
        url, {"type": "list_engines"}, "engines", auth_token=auth_token, timeout=timeout
    )
    engines = reply.get("engines")
    if reply.get("type") != "engines" or not isinstance(engines, list):
        raise RuntimeError(f"unexpected reply from the collector: {reply!r}")
    return [e for e in engines if isinstance(e, dict)]


def send_control(
    url: str,
    engine_id: str,
    changes: dict[str, Any],
    *,
    token: str | None = None,
    auth_token: str | None = None,
    control_id: str | None = None,
    timeout: float = 20.0,
    source: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """Send ``{"type": "control", ...}`` and return the collector's ``control_ack`` (``ok``,
    ``applied_at_step``, ``old``, ``new`` or ``error``). Refusals are answers, not exceptions;
    a message the collector rejects whole (an ``error`` reply) raises RuntimeError.
    ``source`` / ``reason``: who asks and why (``wire.control.relay_declaration``), stored on
    the engine's control events."""
    cid = control_id or f"cli-{os.getpid()}-{next(_ids)}"
    msg: dict[str, Any] = {"type": "control", "id": cid, "engine_id": engine_id, "set": changes}
    if token is not None:
        msg["token"] = token
    if source is not None:
        msg["source"] = source
    if reason is not None:
        msg["reason"] = reason
    reply = exchange(url, msg, "control_ack", cid, auth_token=auth_token, timeout=timeout)
    if reply.get("type") == "error":
        raise RuntimeError(f"collector refused the message: {reply!r}")
    return dict(reply)
