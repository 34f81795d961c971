#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Exit code 5 (no tests collected) is a failure.
# With no arguments: the suite in two phases, the tests that are judged under the machine's own
# load (marked `serial`: the browser stories) alone after the rest, which runs on two workers
# (pytest-xdist, whole files per worker). With arguments: pytest with them, one process.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/lint-imports || exit 1
.venv/bin/mypy || exit 1

run() {
  .venv/bin/python -m pytest -q "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests ($*): failing" >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi
run -n "${CHUNKSCOPE_TEST_WORKERS:-2}" --dist loadfile -m "not serial"
rc1=$?
run -m serial
rc2=$?
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
