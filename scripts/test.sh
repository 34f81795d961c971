#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Exit code 5 (no tests collected) is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/lint-imports || exit 1
.venv/bin/mypy || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
