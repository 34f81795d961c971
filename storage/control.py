"""A control client for the collector's ``/control`` path (used by ``python -m storage control``
and ``engines``; the dashboard may use it too). Synchronous, websockets' sync client."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any
from urllib.parse import quote

_ids = itertools.count(1)


def _open(url: str, auth_token: str | None, timeout: float) -> Any:
    from websockets.sync.client import connect

    target = url.rstrip("/") + "/control"
    if auth_token is not None:
        target += "?token=" + quote(auth_token, safe="")
    return connect(target, open_timeout=timeout, proxy=None)


def list_engines(
    url: str, *, auth_token: str | None = None, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """The engines the collector has seen since it started, connected or not."""
    with _open(url, auth_token, timeout) as ws:
        ws.send(json.dumps({"type": "list_engines"}))
        reply = json.loads(ws.recv(timeout=timeout))
    if reply.get("type") != "engines":
        raise RuntimeError(f"unexpected reply from the collector: {reply!r}")
    return list(reply["engines"])


def send_control(
    url: str,
    engine_id: str,
    changes: dict[str, Any],
    *,
    token: str | None = None,
    auth_token: str | None = None,
    control_id: str | None = None,
    timeout: float = 20.0,
) -> dict[str, Any]:
    """Send ``{"type": "control", ...}`` and return the collector's ``control_ack`` (``ok``,
    ``applied_at_step``, ``old``, ``new`` or ``error``). Refusals are answers, not exceptions."""
    cid = control_id or f"cli-{os.getpid()}-{next(_ids)}"
    msg: dict[str, Any] = {"type": "control", "id": cid, "engine_id": engine_id, "set": changes}
    if token is not None:
        msg["token"] = token
    with _open(url, auth_token, timeout) as ws:
        ws.send(json.dumps(msg))
        while True:
            reply = json.loads(ws.recv(timeout=timeout))
            if reply.get("type") == "control_ack" and reply.get("id") == cid:
                return dict(reply)
            if reply.get("type") == "error":
                raise RuntimeError(f"collector refused the message: {reply!r}")
