"""chunkscope engine: a chunked-prefill LLM serving engine with a live token budget.

Importing this package is cheap and imports no torch; the modules that need torch
(`engine.model`, `engine.model.runner`, `engine.llm_engine`) import it themselves.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
