"""Test kit (not shipped in the wheel): the synthetic engine, collector and PostgreSQL launchers that
tests and benchmarks share. Imported from the repo root (pytest's pythonpath, benchmarks run as
``python -m benchmarks.NAME``)."""
