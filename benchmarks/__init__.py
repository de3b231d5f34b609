"""Benchmarks and the soak, run from the repository root (`python -m benchmarks.soak`,
`python -m benchmarks.serving`); `testing` holds the helpers the tests share."""
