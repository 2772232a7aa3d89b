"""The benchmarks, grouped by purpose; each script runs from the repository root as
``python -m benchmarks.<group>.<name>``.

- :mod:`benchmarks.common`: library modules the scripts (and tests) share: the models, the variants, the report,
  the LM runs, statistics, provenance, launchers. A helper two scripts use lives here, never in a script.
- :mod:`benchmarks.throughput`: speed, memory and cost measurements of the engine and its parts.
- :mod:`benchmarks.convergence`: training-quality comparisons (FDG against backprop, corrections "auto", Muon).
- :mod:`benchmarks.studies`: one-off analyses behind the staleness and delay write-ups.
"""
