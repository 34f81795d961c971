"""The dashboard's side of control: its checks and wording over ``storage.control``, the one
client of the collector's ``/control`` endpoint (docs/telemetry.md): ``list_engines`` and
``control`` -> ``control_ack``, each bounded by a timeout. The dashboard never talks to an engine
directly: the collector relays, and stores every change (accepted or refused).

Values are validated here first (:func:`validate_budget`: the user's text parsed, then the wire's
one rule), so a non-numeric or out-of-range budget is refused in the UI with its reason and never
sent.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from storage.control import CollectorUnavailable, exchange
from wire import credentials
from wire.control import refusal

logger = logging.getLogger(__name__)


LIST_TIMEOUT_S = 3.0
# The collector waits up to 15 s for the engine's answer; leave room for its refusal to arrive.
CONTROL_TIMEOUT_S = 20.0
_ids = itertools.count(1)


@dataclass(frozen=True)
class ControlResult:
    """The collector's ``control_ack``: applied at a step, or refused with a reason."""

    id: str
    ok: bool
    applied_at_step: int | None = None
    error: str | None = None
    old: dict[str, Any] = field(default_factory=dict)
    new: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.ok:
            return f"refused: {self.error or 'no reason given'}"
        changes = ", ".join(
            f"{k} {self.old.get(k, '?')} → {v}" for k, v in sorted(self.new.items())
        )
        return f"applied at step {self.applied_at_step}" + (f" ({changes})" if changes else "")


def validate_budget(value: object, max_budget: int | None) -> int:
    """A token budget the engine will accept, or ValueError saying why not.

    Accepts an int, a float with no fraction, or a string of digits (the UI's text); refuses
    bools, fractions and text, then applies the wire's rule (``wire.control.refusal``): values
    outside 1..``max_budget`` (when the maximum is known).
    """
    if isinstance(value, bool):
        raise ValueError(f"token budget must be a whole number, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"token budget must be a whole number, got {text!r}") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"token budget must be a whole number, got {value}")
        value = int(value)
    if not isinstance(value, int):
        raise ValueError(f"token budget must be a whole number, got {value!r}")
    reason = refusal("token_budget", value, max_token_budget=max_budget, name="token budget")
    if reason is not None:
        raise ValueError(reason)
    return value


def validate_cap(value: object, max_budget: int | None) -> int:
    """A long-prefill cap (``long_prefill_token_threshold``) the engine will accept: checked
    like the budget (a whole number up to ``max_budget``), but 0 (no cap) is allowed."""
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        text = str(value).strip()
        if text in ("0", "0.0"):
            return 0
    try:
        return validate_budget(value, max_budget)
    except ValueError as exc:
        msg = str(exc).replace("token budget", "long-prefill cap").replace("from 1", "from 0")
        raise ValueError(msg) from None


def validate_policy(value: object) -> str:
    reason = refusal("policy", value, max_token_budget=None)
    if reason is not None:
        raise ValueError(reason)
    return str(value)


def list_engines(
    collector_url: str, *, token: str | None = None, timeout: float = LIST_TIMEOUT_S
) -> list[dict[str, Any]]:
    """The engines the collector knows (``connected`` says which are live). ``token``: the
    collector's control token, which opens ``/control``."""
    reply = exchange(
        collector_url, {"type": "list_engines"}, "engines", auth_token=token, timeout=timeout
    )
    engines = reply.get("engines")
    if not isinstance(engines, list):
        raise CollectorUnavailable(f"collector sent no engine list: {reply!r}")
    return [e for e in engines if isinstance(e, dict)]


def set_scheduler(
    collector_url: str,
    engine_id: str,
    *,
    token_budget: int | None = None,
    policy: str | None = None,
    token: str | None = None,
    timeout: float = CONTROL_TIMEOUT_S,
    long_prefill_token_threshold: int | None = None,
) -> ControlResult:
    """Ask ``engine_id`` (through the collector) to change its budget, policy and/or
    long-prefill cap."""
    changes: dict[str, Any] = {}
    if token_budget is not None:
        changes["token_budget"] = token_budget
    if policy is not None:
        changes["policy"] = policy
    if long_prefill_token_threshold is not None:
        changes["long_prefill_token_threshold"] = long_prefill_token_threshold
    if not changes:
        raise ValueError("nothing to change: give a token budget, a policy or a cap")
    msg_id = f"dash-{os.getpid()}-{next(_ids)}-{time.monotonic_ns() % 1_000_000}"
    message: dict[str, Any] = {
        "type": "control",
        "id": msg_id,
        "engine_id": engine_id,
        "set": changes,
    }
    token = token if token is not None else credentials.from_env(credentials.CONTROL_ENV)
    # The control token opens /control; the collector MACs the control with it for the engine.
    reply = exchange(
        collector_url, message, "control_ack", msg_id, auth_token=token or None, timeout=timeout
    )
    if reply.get("type") == "error":  # the collector rejected the message whole
        reply = {"ok": False, "error": reply.get("message") or reply.get("code")}
    step = reply.get("applied_at_step")
    return ControlResult(
        id=msg_id,
        ok=bool(reply.get("ok")),
        applied_at_step=int(step) if isinstance(step, int) else None,
        error=reply.get("error") or reply.get("message"),
        old=reply.get("old") or {},
        new=reply.get("new") or {},
    )
