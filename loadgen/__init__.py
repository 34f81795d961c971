"""chunkscope load generator: chat, RAG, VLM and mixed traffic against OpenAI-compatible servers.

Never imports torch or the engine: it must run against any server (vLLM, SGLang, chunkscope).
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
