"""Convergence benchmarks; run each as ``python -m benchmarks.convergence.<name>``."""
