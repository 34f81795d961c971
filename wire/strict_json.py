"""The one rule for JSON that crosses a trust boundary: engine request bodies, collector frames
and control messages. Stdlib only.

Plain ``json.loads`` takes ``NaN`` and ``Infinity`` (not JSON, and poison once stored or
exported) and raises ``RecursionError`` for deep nesting, which servers turn into 500/1011.
:func:`loads` refuses both with a reason a client can act on, as a :class:`JSONRefused`
(a ``ValueError``).
"""

from __future__ import annotations

import json
from typing import Any

# Deepest nesting accepted (an object in a list counts two). chunkscope's deepest message is a
# telemetry frame (frame > events > event > chunks > chunk: 5); an OpenAI chat body with an
# image is 6. 32 leaves room for a hello's config and for clients' extra fields.
MAX_DEPTH = 32


class JSONRefused(ValueError):
    """JSON that is refused; ``str(exc)`` is the reason."""


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number (NaN and Infinity are refused)")


def depth_over(value: Any, limit: int) -> bool:
    """True when ``value`` (parsed JSON) nests containers deeper than ``limit``. Iterative."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if type(node) is dict else node
        for child in children:
            if type(child) is dict or type(child) is list:
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` as JSON, or :class:`JSONRefused` saying why not: malformed, NaN/Infinity, or
    nested deeper than ``max_depth``. ``UnicodeDecodeError`` (also a ValueError) for bytes
    that are not UTF-8."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except JSONRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JSONRefused(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise JSONRefused(f"JSON nested deeper than {max_depth} levels") from None
    if type(value) is dict or type(value) is list:
        # Cheap exit: fewer brackets in all than the limit cannot nest past it.
        brackets = text.count("[") + text.count("{") if isinstance(text, str) else None
        if (brackets is None or brackets > max_depth) and depth_over(value, max_depth):
            raise JSONRefused(f"JSON nested deeper than {max_depth} levels")
    return value
