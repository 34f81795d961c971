"""``python -m engine``: run the OpenAI-compatible engine server."""

from __future__ import annotations

from engine.server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
