"""radixserve's inference engine as a library: no HTTP, no ZMQ."""

import os

# Before torch loads OpenMP (importing `engine` first is enough): idle OpenMP threads sleep
# instead of spinning. On a CPU shared with anything else (the tokenizer and detokenizer
# processes, a client, the forward thread's own Python side) spinning threads turned a
# 45 ms decode step into 350 ms (benchmarks in docs/benchmarks/model.md). Set the variable
# yourself to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
