"""The live scheduler controls on the wire: the keys, the policies and the one rule for a value.

Every place that takes a change runs :func:`refusal` / :func:`check_changes`: the scheduler's
setters, ``PUT /v1/scheduler``, the telemetry relay, the collector and the dashboard (after it
has parsed the user's text into a number), so a refusal reads the same wherever it happens.
Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping

CAP_KEY = "long_prefill_token_threshold"
CONTROL_KEYS = ("token_budget", "policy", CAP_KEY)
POLICIES = ("chunked", "unchunked")
# The integer keys and their least value: a budget of at least one token; the long-prefill cap
# (vLLM's name for it) may be 0, which turns it off. Both at most the engine's maximum budget.
INT_KEYS: dict[str, int] = {"token_budget": 1, CAP_KEY: 0}


class ControlRefused(ValueError):
    """A scheduler change refused; ``reason`` says why, ``param`` names the key when one is at
    fault. ``recorded``: the engine already emitted its refused ``control`` events (so a relay
    must not record the refusal again)."""

    def __init__(self, reason: str, param: str | None = None, *, recorded: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.param = param
        self.recorded = recorded


def refusal(
    key: str,
    value: object,
    *,
    max_token_budget: int | None,
    policies: tuple[str, ...] = POLICIES,
    name: str | None = None,
) -> str | None:
    """Why ``key: value`` is refused, or None when it is a valid change.

    ``max_token_budget`` None: the maximum is not known (the budget must then be 1 or more).
    ``name``: what the reason calls the key (a UI's label, "token budget"); the key itself by
    default.
    """
    name = name or key
    if key not in CONTROL_KEYS:
        return f"unknown key {key!r}: the keys are {list(CONTROL_KEYS)}"
    if key in INT_KEYS:
        least = INT_KEYS[key]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
        if value < least or (max_token_budget is not None and value > max_token_budget):
            bound = (
                f"from {least} to {max_token_budget}"
                if max_token_budget is not None
                else f"from {least} or more"
            )
            return f"{name} must be {bound}, got {value}"
        return None
    if value not in policies:
        return f"{name} must be one of {', '.join(policies)}, got {value!r}"
    return None


def check_changes(
    changes: object,
    max_token_budget: int | None,
    policies: tuple[str, ...] = POLICIES,
) -> dict[str, object]:
    """The changes as a dict in ``CONTROL_KEYS`` order, or ``ControlRefused`` for the first bad
    key or value (``param`` names it). Pure: every receiver runs the very same checks."""
    if not isinstance(changes, Mapping) or not changes:
        raise ControlRefused(
            "changes must be a non-empty object such as "
            f'{{"token_budget": 512}} or {{"policy": "{policies[0]}"}}, got {changes!r}'
        )
    for key, value in changes.items():
        reason = refusal(str(key), value, max_token_budget=max_token_budget, policies=policies)
        if reason is not None:
            raise ControlRefused(reason, param=str(key))
    return {k: changes[k] for k in CONTROL_KEYS if k in changes}


# ---- who asked: the source a relayed control is stored with ----------------------------------
# A /control client may say who it is (``"source"``) and why (``"reason"``); the collector stamps
# both on the engine's control events for that control id as it stores them (the engine itself
# reports every relayed control as ``collector``). One vocabulary, checked here.

RELAY_SOURCES = ("collector", "autopilot")
MAX_REASON_CHARS = 500


def relay_declaration(msg: Mapping[str, object]) -> tuple[str, str | None]:
    """The ``(source, reason)`` a /control message declares (``collector`` and None when it
    declares nothing), or ``ControlRefused`` for an unknown source or a reason that is not a
    string of at most ``MAX_REASON_CHARS`` characters."""
    source = msg.get("source", "collector")
    if source not in RELAY_SOURCES:
        raise ControlRefused(
            f"source must be one of {', '.join(RELAY_SOURCES)}, got {source!r}", param="source"
        )
    reason = msg.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS):
        raise ControlRefused(
            f"reason must be a string of at most {MAX_REASON_CHARS} characters", param="reason"
        )
    return str(source), reason


# ---- steering credential on the relay -----------------------------------------------------------
# The collector never forwards an operator's control token to an engine connection: it sends a
# MAC of the control under that token instead, bound to the engine, run and control id, which the
# engine checks with its own ``--control-token``. A connection that is not the engine learns
# nothing it could present to ``PUT /v1/scheduler`` or replay to another run.

_MAC_CONTEXT = b"chunkscope-control-mac-v1\n"


def control_mac(
    token: str, *, control_id: str, engine_id: str, run_id: str, changes: Mapping[str, object]
) -> str:
    """HMAC-SHA256 (hex) of one relayed control under ``token``."""
    body = json.dumps(
        {"id": control_id, "engine_id": engine_id, "run_id": run_id, "set": dict(changes)},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return hmac.new(token.encode(), _MAC_CONTEXT + body.encode(), hashlib.sha256).hexdigest()


def same_secret(given: object, expected: str) -> bool:
    """Constant-time comparison of a presented secret with the expected one; False for a value
    that is not a string (non-ASCII text is compared as UTF-8, never raises)."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
