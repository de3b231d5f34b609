"""What the tests and the benchmarks share, in one place that both import.

- `models`: tiny random-weight Llama, Qwen2 and Qwen3 models, saved with a real tokenizer
  when asked (`save_tiny_llama`: the one the service tests and the soak serve).
- `launcher`: the three services as real processes on free ports (`ServiceLauncher`).
- `server_process`: a benchmark peer's server as a subprocess, stopped when the block ends.
- `net`: free ports, `wait_until`, and the HTTP probes of a local server.
- `grammar_schemas`: the JSON schemas, with prompts, of the constrained-decoding tests.
- `batches`: forward and sampling batches built by hand, for tests and benchmarks that
  drive a `ModelRunner` or the sampler without a scheduler.
- `radix`: prefix caches over small CPU pools, for the cache and scheduler tests and
  `benchmarks/radix_bench.py`.
- `kv_events`: a router's side of the KV-cache events (the wire format only).
- `imports`: the import graph of the tree, for the layering tests.

The submodules are imported one by one: `models` loads torch and transformers, `batches`
and `radix` the engine and torch, which the rest do not need.
"""
