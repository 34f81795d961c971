"""The collector's health as the dashboard shows it: ``GET /healthz`` on the collector's port
answers 200, or 503 naming the store's problem (a failed batch, or one that has waited on the
store for seconds). One short request, bounded by a timeout, never through a proxy."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

HEALTH_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class CollectorHealth:
    """``ok``: True (200), False (it answered that it is not healthy), None (no answer)."""

    ok: bool | None
    detail: str

    @property
    def store_outage(self) -> bool:
        return self.ok is False


def health_url(collector_url: str) -> str:
    """``ws://HOST:PORT[/...]`` -> ``http://HOST:PORT/healthz`` (``wss`` -> ``https``)."""
    parts = urlsplit(collector_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not a collector URL: {collector_url!r}")
    return f"{scheme}://{parts.netloc}/healthz"


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def check(collector_url: str, timeout: float = HEALTH_TIMEOUT_S) -> CollectorHealth:
    """The collector's answer to ``/healthz`` within ``timeout`` seconds."""
    try:
        url = health_url(collector_url)
    except ValueError as exc:
        return CollectorHealth(None, str(exc))
    try:
        with _opener.open(url, timeout=timeout) as resp:
            return CollectorHealth(True, _text(resp.read()))
    except urllib.error.HTTPError as exc:
        body = _text(exc.read()) if exc.fp is not None else ""
        return CollectorHealth(False, body or f"HTTP {exc.code}")
    except (OSError, ValueError) as exc:  # refused, timed out, reset, a bad answer
        reason = getattr(exc, "reason", exc)
        return CollectorHealth(None, str(reason))


def _text(body: bytes) -> str:
    return body.decode("utf-8", "replace").strip()[:300]
