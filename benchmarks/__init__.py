"""Benchmarks and the soak, run from the repository root (`python -m benchmarks.soak`,
`python -m benchmarks.serving`); `benchmarks.support` holds the helpers the tests share."""
