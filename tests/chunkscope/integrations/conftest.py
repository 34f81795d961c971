"""Fixtures of the tests against a real vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chunkscope.integrations.vllm_helpers import vllm_python


@pytest.fixture(scope="module")
def vllm_py() -> Path:
    """The vLLM venv's python; without it the test skips, or fails saying how to make it when
    ``CHUNKSCOPE_REQUIRE_VLLM=1`` (CI)."""
    py = vllm_python()
    if py is None:
        msg = (
            "no vLLM environment: run scripts/setup_vllm.sh (it makes the venv at "
            "$CHUNKSCOPE_VLLM_VENV, default ~/.cache/chunkscope/vllm-venv)"
        )
        if os.environ.get("CHUNKSCOPE_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py
