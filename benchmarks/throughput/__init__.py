"""Throughput, memory and cost benchmarks; run each as ``python -m benchmarks.throughput.<name>``."""
