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
import json
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wire.control import same_secret

PUBLISH_ENV = "CHUNKSCOPE_PUBLISH_TOKEN"
CONTROL_ENV = "CHUNKSCOPE_CONTROL_TOKEN"
API_KEY_ENV = "CHUNKSCOPE_API_KEY"
LEGACY_ENV = "CHUNKSCOPE_AUTH_TOKEN"
OPT_OUT_FLAG = "--allow-unauthenticated"
# The store's URL may hold a password (postgresql+psycopg://user:pw@host/db): a program that
# starts another hands it over in this variable, never as --db (a command line is readable by
# every local user through ps); each CLI's --db falls back to it.
DB_URL_ENV = "CHUNKSCOPE_DB_URL"


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


# ---- per-engine credentials ------------------------------------------------------------------
# A collector may be given a file of credentials of its own for some engines (``--credentials-
# file``): a listed engine publishes only with its own publish token and is steered only with
# its own control token (the engine checks a relayed control's MAC under that same token, so
# it is started with it as its --control-token). Engines not listed keep the shared tokens.

CREDENTIALS_FILE_ENV = "CHUNKSCOPE_CREDENTIALS_FILE"
MAX_ENGINE_ID_CHARS = 128  # as the collector's hello check


class CredentialsFileError(ValueError):
    """A credentials file that cannot be used; ``str(exc)`` says why, never a token."""


@dataclass(frozen=True)
class EngineCredentials:
    """One engine's own tokens (kept out of ``repr``)."""

    publish: str = field(repr=False)
    control: str = field(repr=False)


def _check_token(where: str, token: object) -> str:
    if not isinstance(token, str) or not token:
        raise CredentialsFileError(f"{where} must be a non-empty string")
    if not token.isascii() or not token.isprintable() or " " in token:
        raise CredentialsFileError(
            f"{where} must be printable ASCII without spaces (it travels in HTTP headers)"
        )
    return token


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CredentialsFileError(f"{key!r} appears twice")
        out[key] = value
    return out


def parse_engine_credentials(text: str, *, toml: bool) -> dict[str, EngineCredentials]:
    """The engines of a credentials file's ``text`` (TOML, else JSON)::

        [engines."engine-a"]         {"engines": {"engine-a":
        publish = "..."                  {"publish": "...", "control": "..."}}}
        control = "..."

    :class:`CredentialsFileError` for anything else: syntax, an engine id twice, a missing or
    unknown field, an empty or non-ASCII token, one token used twice (two engines, or one
    engine's publish and control)."""
    try:
        if toml:
            doc: Any = tomllib.loads(text)  # refuses a key given twice itself
        else:
            doc = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except CredentialsFileError:
        raise
    except ValueError as exc:  # TOMLDecodeError and JSONDecodeError: where, never what
        raise CredentialsFileError(f"not valid {'TOML' if toml else 'JSON'}: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"engines"} or not isinstance(doc["engines"], dict):
        raise CredentialsFileError(
            "expected one table 'engines' mapping each engine id to {publish, control}"
        )
    out: dict[str, EngineCredentials] = {}
    seen: set[str] = set()
    for engine_id, entry in doc["engines"].items():
        if not engine_id or len(engine_id) > MAX_ENGINE_ID_CHARS or not engine_id.isprintable():
            raise CredentialsFileError(
                f"engine id {engine_id[:40]!r} must be printable and 1 to "
                f"{MAX_ENGINE_ID_CHARS} characters"
            )
        where = f"engine {engine_id!r}"
        if not isinstance(entry, dict):
            raise CredentialsFileError(f"{where}: expected a table with publish and control")
        missing = [k for k in ("publish", "control") if k not in entry]
        if missing:
            raise CredentialsFileError(f"{where}: missing {' and '.join(missing)}")
        unknown = sorted(set(entry) - {"publish", "control"})
        if unknown:
            raise CredentialsFileError(f"{where}: unknown field(s) {', '.join(unknown)}")
        creds = EngineCredentials(
            publish=_check_token(f"{where}: publish", entry["publish"]),
            control=_check_token(f"{where}: control", entry["control"]),
        )
        for kind, token in (("publish", creds.publish), ("control", creds.control)):
            if token in seen:
                raise CredentialsFileError(
                    f"{where}: its {kind} token is used twice in the file (each engine's "
                    "publish and control tokens must differ from each other and from every "
                    "other engine's)"
                )
            seen.add(token)
        out[engine_id] = creds
    return out


def load_engine_credentials(path: str | os.PathLike[str]) -> dict[str, EngineCredentials]:
    """The credentials file at ``path`` (``.toml``, else JSON), read once;
    :class:`CredentialsFileError` naming the file and what is wrong (never a token)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            text = f.read().decode("utf-8")
    except OSError as exc:
        raise CredentialsFileError(f"{name}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CredentialsFileError(f"{name}: not UTF-8 text") from None
    try:
        return parse_engine_credentials(text, toml=not name.endswith(".json"))
    except CredentialsFileError as exc:
        raise CredentialsFileError(f"{name}: {exc}") from None


def clash_with_shared(
    engines: Mapping[str, EngineCredentials], shared: Iterable[str | None]
) -> str:
    """Why ``engines``' tokens cannot be used beside the ``shared`` ones ("" when they can): an
    engine's own token equal to a shared token would give its holder every engine."""
    common = {t for t in shared if t}
    for engine_id, creds in engines.items():
        if creds.publish in common or creds.control in common:
            return (
                f"--credentials-file: engine {engine_id!r} has a token equal to a shared one "
                "(--publish-token, --control-token or --auth-token): give it tokens of its own"
            )
    return ""


def may_publish(
    engine_id: str,
    presented: object,
    *,
    shared: str | None,
    engines: Mapping[str, EngineCredentials],
) -> str:
    """Why a hello for ``engine_id`` presenting ``presented`` may not publish ("" when it may).
    A listed engine needs its own publish token; any other needs ``shared`` (None: nothing)."""
    own = engines.get(engine_id)
    if own is not None:
        if same_secret(presented, own.publish):
            return ""
        return f"missing or wrong publish token for engine {engine_id[:MAX_ENGINE_ID_CHARS]!r}"
    if shared is None or same_secret(presented, shared):
        return ""
    return "missing or wrong publish token"


def may_steer(
    engine_id: str,
    presented: object,
    *,
    shared: str | None,
    engines: Mapping[str, EngineCredentials],
) -> str:
    """Why a control client presenting ``presented`` may not steer ``engine_id`` ("" when it
    may). A listed engine only with its own control token (the one its MAC is checked with);
    any other with ``shared`` (None: no token needed, as without credentials)."""
    own = engines.get(engine_id)
    if own is not None:
        if same_secret(presented, own.control):
            return ""
        return (
            f"missing or wrong control token for engine {engine_id[:MAX_ENGINE_ID_CHARS]!r} "
            "(it is steered with its own token)"
        )
    if shared is None or same_secret(presented, shared):
        return ""
    return "missing or wrong control token"


def steers_only(presented: object, engines: Mapping[str, EngineCredentials]) -> str | None:
    """The one engine id whose own control token ``presented`` is (None: no engine's)."""
    for engine_id, creds in engines.items():
        if same_secret(presented, creds.control):
            return engine_id
    return None
