"""chunkscope engine: a chunked-prefill LLM serving engine with a live token budget.

Importing this package is cheap and imports no torch; the modules that need torch
(`engine.model`, `engine.model.runner`, `engine.llm_engine`) import it themselves.
"""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    # the one version, pyproject.toml's (an editable install reads it when installed)
    __version__ = version("chunkscope")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
