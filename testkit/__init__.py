"""Test kit, not shipped in the wheel: the synthetic engine, the collector and PostgreSQL
launchers that tests and benchmarks share. Imported from the repo root (pytest's pythonpath;
benchmarks run from the root)."""
