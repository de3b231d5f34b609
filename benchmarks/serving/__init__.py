"""Serving benchmark: one async client for any OpenAI-compatible server, deterministic
workloads, and a driver that measures radixserve beside transformers `generate` on the same
workloads and model.

    python -m benchmarks.serving --base-url http://127.0.0.1:30000 --workload shared-prefix
    python -m benchmarks.serving.compare          # the peer matrix, into docs/benchmarks/
    python -m benchmarks.serving.decode_ceiling   # bytes per decode step against bandwidth

Modules: `workloads` (what is sent), `client` (how it is sent and timed), `metrics`
(percentiles, summaries, /metrics counters), `server_peer` and `hf_peer` (the peers),
`decode_ceiling`, `record` (reading the matrix's JSON record), `report` (markdown,
machine) and `plots`, `compare` (the matrix).
"""
