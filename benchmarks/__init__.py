"""fusednorm's benchmark suites (`python -m benchmarks`); results land in benchmarks/results/."""
