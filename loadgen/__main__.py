"""`python -m loadgen`."""

from __future__ import annotations

from loadgen.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
