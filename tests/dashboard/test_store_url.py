"""The dashboard never shows a database password: not in the sidebar's store line, not in the
reason a page gives when the store cannot be opened."""

from __future__ import annotations

import pytest

from dashboard import data

SECRET = "p%40ss%25w0rd"  # "p@ss%w0rd", escaped as a URL holds it


def test_the_store_url_is_shown_without_its_password() -> None:
    shown = data.shown_url(f"postgresql+psycopg://u:{SECRET}@db.example:5432/chunkscope")
    assert shown == "postgresql+psycopg://u:***@db.example:5432/chunkscope"
    assert data.shown_url("sqlite:///data/chunkscope.db") == "sqlite:///data/chunkscope.db"
    assert data.shown_url(None) == "—"


def test_a_store_that_cannot_be_opened_says_why_without_the_password() -> None:
    with pytest.raises(data.StoreUnavailable) as info:
        data.connection(f"postgresql+psycopg://u:{SECRET}@127.0.0.1:notaport/chunkscope")
    assert "ss%25w0rd" not in str(info.value) and "ss%w0rd" not in str(info.value)
    assert "u:***@" in str(info.value)
