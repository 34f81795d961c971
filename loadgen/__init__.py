"""chunkscope load generator: chat, RAG, VLM and mixed traffic against OpenAI-compatible servers.

Never imports torch or the engine: it must run against any server (vLLM, SGLang, chunkscope).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("chunkscope")  # the one version, pyproject.toml's
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
