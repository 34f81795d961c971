"""Who may do what, named once: the credentials of publishing and steering, the engine's API
key, and the loopback rule every service applies when it binds. Stdlib only.

- **publish** (``--publish-token`` / ``CHUNKSCOPE_PUBLISH_TOKEN``): engines present it in their
  hello on the collector's ``/ingest``. It opens nothing else.
- **steer** (``--control-token`` / ``CHUNKSCOPE_CONTROL_TOKEN``): control clients present it on
  the collector's ``/control`` (``Authorization: Bearer`` or ``?token=``) and on an engine's
  ``PUT /v1/scheduler``; an engine checks relayed controls by a MAC under it
  (``wire.control.control_mac``), so the collector never hands it to an engine connection.
- **serve** (``--api-key`` / ``CHUNKSCOPE_API_KEY``, as vLLM's ``--api-key`` / ``VLLM_API_KEY``):
  the engine's ``/v1`` routes; ``/health``, ``/metrics`` and ``/version``-style routes stay open.
- ``CHUNKSCOPE_AUTH_TOKEN`` / ``--auth-token``: the one token of older releases; where the
  specific one is not given it stands in for both publish and steer.

A service told to bind an address that is not loopback without the credentials that guard it
refuses to start (:func:`bind_refusal`) unless given ``--allow-unauthenticated``.
"""

from __future__ import annotations

import ipaddress
import os

PUBLISH_ENV = "CHUNKSCOPE_PUBLISH_TOKEN"
CONTROL_ENV = "CHUNKSCOPE_CONTROL_TOKEN"
API_KEY_ENV = "CHUNKSCOPE_API_KEY"
LEGACY_ENV = "CHUNKSCOPE_AUTH_TOKEN"
OPT_OUT_FLAG = "--allow-unauthenticated"


def from_env(name: str, *, legacy: bool = False) -> str | None:
    """The environment's value of ``name`` ("" counts as unset), else, with ``legacy``, that of
    ``CHUNKSCOPE_AUTH_TOKEN``."""
    value = os.environ.get(name) or None
    if value is None and legacy:
        value = os.environ.get(LEGACY_ENV) or None
    return value


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach: 127.0.0.0/8, ::1 and ``localhost``.
    "" and 0.0.0.0 / :: (every interface) and any other name are not."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_refusal(service: str, host: str, missing: dict[str, str], *, allowed: bool) -> str:
    """Why ``service`` may not bind ``host`` ("" when it may). ``missing``: flag -> what it
    guards, for each credential not given. Loopback, no missing credential, or ``allowed``
    (``--allow-unauthenticated``): ""."""
    if allowed or not missing or is_loopback(host):
        return ""
    needs = "; ".join(f"{flag} ({what})" for flag, what in missing.items())
    return (
        f"{service} refuses to listen on {host or 'every interface'!r} without credentials: "
        f"anyone who can reach it could use it. Give {needs}, bind 127.0.0.1, or pass "
        f"{OPT_OUT_FLAG} if the network itself is trusted (see docs/security.md)"
    )
