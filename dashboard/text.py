"""Text from elsewhere (an engine's refusal, a child's log line) shown as text.

Streamlit's ``st.error`` / ``st.warning`` / ``st.markdown`` render their body as Markdown (with
HTML-free links, emphasis, ``:emoji:`` short codes and ``$…$`` LaTeX). An engine's error text is
not ours: ``**``, ``[x](http://…)`` or ``$`` in it must reach the operator as those characters.
CommonMark lets a backslash escape every ASCII punctuation character, so :func:`as_text`
escapes them all, keeps line breaks, and turns a line's leading spaces into no-break spaces
(four would start a code block).
"""

from __future__ import annotations

import string

_ESCAPE = {ord(c): "\\" + c for c in string.punctuation}


def as_text(value: object) -> str:
    """``value`` as Markdown source that renders as exactly its characters."""
    lines = []
    for line in str(value).translate(_ESCAPE).splitlines():
        body = line.lstrip(" \t")
        lines.append("\u00a0" * (len(line) - len(body)) + body)
    return "  \n".join(lines)  # two spaces: a hard line break, as in the original
