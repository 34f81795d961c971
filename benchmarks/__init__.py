"""Benchmarks, run from the repo root as ``python -m benchmarks.NAME`` (not shipped)."""
