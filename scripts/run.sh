#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the dashboard. With nothing else running it starts its
# own collector (SQLite store in ./data) and a CPU `demo` engine, and stops them when it exits.
# Open http://127.0.0.1:8501, start traffic in the sidebar, lower the budget on the Control page.
# Flags after `--` go to the dashboard, e.g. attach to a running collector and store:
#   bash scripts/run.sh -- --collector ws://127.0.0.1:8765 --db sqlite:///data/chunkscope.db
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m streamlit run dashboard --server.address 127.0.0.1 \
  --server.headless true --browser.gatherUsageStats false --client.toolbarMode viewer "$@"
