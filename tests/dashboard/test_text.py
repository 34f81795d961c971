"""Text from elsewhere renders as its characters, not as Markdown."""

from __future__ import annotations

import pytest
from markdown_it import MarkdownIt

from dashboard.text import as_text

HOSTILE = [
    "token_budget must be **at most** 8192",
    "see [the docs](http://evil.example/x) or ![img](http://evil.example/p.png)",
    "# heading\n- item\n> quote\n`code` $x^2$ :warning: <b>bold</b> \\ back_slash_",
    "1. listed\n\n    indented code",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_as_text_renders_the_characters_themselves(text: str) -> None:
    html = MarkdownIt("commonmark").render(as_text(text))
    for tag in ("<strong>", "<em>", "<a ", "<img", "<h1>", "<ul>", "<ol>", "<blockquote>", "<b>"):
        assert tag not in html, (tag, html)
    assert "<code>" not in html and "<pre>" not in html
    # every line's characters survive (HTML-escaped by the renderer)
    import html as h

    plain = h.unescape(html.replace("<p>", "").replace("</p>", "").replace("<br />", ""))
    for line in text.splitlines():
        assert line.strip() in plain
