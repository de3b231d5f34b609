"""What the tests and the benchmarks share, in one place that both import.

- `models`: tiny random-weight Llama, Qwen2 and Qwen3 models, saved with a real tokenizer
  when asked (`save_tiny_llama`: the one the service tests and the soak serve).
- `launcher`: the three services as real processes on free ports (`ServiceLauncher`).
- `net`: free ports, `wait_until`, and the HTTP probes of a local server.
- `grammar_schemas`: the JSON schemas, with prompts, of the constrained-decoding tests.
- `radix`: prefix caches over small CPU pools, for the cache and scheduler tests and
  `benchmarks/radix_bench.py`.

The submodules are imported one by one: `models` loads torch and transformers, which the
rest do not need.
"""
