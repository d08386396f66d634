"""Benchmark scripts whose tables the docs quote (run each as ``python benchmarks/X.py``)."""
