"""chunkscope: the `chunkscope` command (cli.py) above the packages it dispatches to, and the
bridges to other engines (integrations/)."""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    # the one version, pyproject.toml's (an editable install reads it when installed)
    __version__ = version("chunkscope")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
