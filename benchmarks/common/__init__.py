"""Library modules shared by the benchmarks: the models, the measured variants, the throughput report."""
