"""Suite-wide fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_main_module() -> Iterator[None]:
    """Streamlit's script runner (``AppTest``) installs the page script as ``sys.modules
    ["__main__"]`` and leaves it there. A later test that spawns an engine core with
    multiprocessing's ``spawn`` would then make the child re-run the dashboard script as its main
    module (which parses pytest's argv and exits), so every such test after a dashboard test
    failed with "the engine core died while starting". Put the real ``__main__`` back."""
    main = sys.modules.get("__main__")
    yield
    if main is not None and sys.modules.get("__main__") is not main:
        sys.modules["__main__"] = main
