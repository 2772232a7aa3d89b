"""Library modules shared by the benchmarks (and their tests): models, variants, report, LM runs, statistics."""
