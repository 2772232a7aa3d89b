"""Studies behind the staleness and delay write-ups; run each as ``python -m benchmarks.studies.<name>``."""
