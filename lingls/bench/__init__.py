"""Benchmarks: `lingls bench WHAT` runs lingls.bench.WHAT.main(argv); results go to bench/results/."""
