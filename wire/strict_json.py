"""The one rule for JSON that crosses a trust boundary: engine request bodies, collector frames
and control messages. Stdlib only.

Plain ``json.loads`` takes ``NaN`` and ``Infinity`` (not JSON, and poison once stored or
exported), reads a number too large for a float (``1e999``) as infinity, and raises
``RecursionError`` for deep nesting, which servers turn into 500/1011. :func:`loads` refuses all
three with a reason a client can act on, as a :class:`JSONRefused` (a ``ValueError``).

Cost: the collector parses every telemetry frame with this (a 64-chunk frame is ~150 KB), so
the checks stay at C speed. NaN/Infinity: the C scanner's ``parse_constant`` hook, called only
when such a constant appears; numbers with a fraction or exponent: its ``parse_float`` hook
(telemetry events carry integers only, so a frame calls it rarely). Depth:
:func:`text_depth_over` reads the nesting from the text's brackets with
``bytes.translate``/``bytes.replace`` (a fraction of the parse's own time); only a text with a
bracket inside a string is walked as parsed values (:func:`depth_over`).
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


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0.0:  # inf - inf is nan; a finite float gives 0.0
        raise JSONRefused(
            f"{text[:40]} is not a finite number (too large for a 64-bit float; NaN and "
            "Infinity are refused)"
        )
    return value


# One decoder for every call (json.loads with a hook builds a new one each time). Safe to share
# between threads like json's own default decoder: its scanner keeps no state across calls.
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)

# The text's structure: quotes and brackets kept, "{" and "}" read as "[" and "]", all else gone.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')


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


def text_depth_over(text: bytes, limit: int) -> bool | None:
    """For ``text``, UTF-8 bytes of **valid** JSON: True when it nests containers deeper than
    ``limit``, False when not, None when this cannot tell (a string holds a bracket).

    Every step is one C-level pass: drop the escapes that can hide a quote (``\\\\`` then
    ``\\"``, left to right as JSON reads them) and keep only quotes and brackets. Then every
    quote is in an empty string ``""`` (counted left to right) exactly when no string holds a
    bracket: the opening quote of one that does is never in such a pair. If some quote is not,
    None. Otherwise the brackets alone are the nesting, and each ``replace("[]", "")`` removes
    exactly the innermost containers, so it is empty after ``limit`` passes exactly when the
    depth is at most ``limit``. UTF-8 never uses these ASCII bytes inside a multi-byte
    character."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = text.translate(_BRACKETS, _NOT_STRUCTURE)
    nesting = structure.translate(None, b'"')
    if 2 * structure.count(b'""') != len(structure) - len(nesting):
        return None
    for _ in range(limit):
        if not nesting:
            return False
        nesting = nesting.replace(b"[]", b"")
    return bool(nesting)


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """``text`` as JSON, or :class:`JSONRefused` saying why not: malformed, NaN/Infinity, or
    nested deeper than ``max_depth``. ``UnicodeDecodeError`` (also a ValueError) for bytes
    that are not UTF-8."""
    utf8: bytes | None = None
    if isinstance(text, (bytes, bytearray)):
        encoding = json.detect_encoding(text)  # what json.loads does with bytes
        if encoding == "utf-8":
            utf8 = bytes(text)
        text = text.decode(encoding, "surrogatepass")
    elif isinstance(text, str) and text.startswith("\ufeff"):  # as json.loads
        raise JSONRefused("malformed JSON: Unexpected UTF-8 BOM (decode using utf-8-sig)")
    try:
        value = _DECODER.decode(text)
    except JSONRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JSONRefused(
            f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise JSONRefused(f"JSON nested deeper than {max_depth} levels") from None
    # Nesting past the limit needs more than 2 * max_depth characters.
    if (type(value) is dict or type(value) is list) and len(text) > 2 * max_depth:
        if utf8 is None:
            utf8 = text.encode("utf-8", "surrogatepass")
        over = text_depth_over(utf8, max_depth)
        if over is None:
            over = depth_over(value, max_depth)
        if over:
            raise JSONRefused(f"JSON nested deeper than {max_depth} levels")
    return value
