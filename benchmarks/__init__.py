"""Measurement scripts, each runnable as `python -m benchmarks.NAME` from the repository root."""
