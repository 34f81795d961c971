"""The parts of ``python -m benchmarks.stall``: workload, measure, analysis, report."""
