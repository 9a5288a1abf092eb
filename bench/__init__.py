"""lingls' GPU benchmarks, one module each, run from the repository root as `python -m bench.NAME`.

bench/README.md says what each measures; `bench.common` holds what they share. The recorded results the docs
cite are in bench/results/. `lingls bench ...` (lingls/bench/) holds the benchmarks an installed lingls runs.
"""
