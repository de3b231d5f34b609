"""radixserve's inference engine as a library: no HTTP, no ZMQ."""

import os

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
"""Set before torch loads OpenMP (importing `engine` first is enough): an idle OpenMP thread
spins for 10000 turns (microseconds), then sleeps. A decode step is hundreds of short
parallel regions, and waking sleeping threads for each slows a step down; spinning without
end (libgomp's default) fights anything else on the CPU (the tokenizer and detokenizer, a
client, the forward thread's own Python side) and slows it far more. Figures:
docs/benchmarks/model.md. Setting OMP_WAIT_POLICY yourself overrides both."""

OPENMP_SET_HERE = (
    {k: v for k, v in OPENMP_DEFAULTS.items() if k not in os.environ}
    if "OMP_WAIT_POLICY" not in os.environ
    else {}
)
"""What this import added to the environment: a benchmark that starts another checkout's
engine in a subprocess leaves these out, so that the checkout applies its own defaults."""
os.environ.update(OPENMP_SET_HERE)
