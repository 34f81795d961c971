#!/usr/bin/env bash
# Set up (idempotent) and run the main job. Until the dashboard lands, that is the terminal demo:
# chat streams decoding while a long RAG prompt arrives, under the chunked and unchunked policies.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m engine.demo "$@"
