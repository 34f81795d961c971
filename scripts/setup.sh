#!/usr/bin/env bash
# Set up chunkscope in ./.venv on a fresh machine: torch first (the CPU build pinned below lies on
# local disk here; pip takes it without a multi-GB download), then the project with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "chunkscope: environment ready in .venv"
