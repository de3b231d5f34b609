"""Sampling: per-request parameters, their batched tensors, penalties and the sampler.

Nothing is re-exported here, so that importing `sampling_params` (which the tokenizer
validates requests with) loads neither the batched tensors nor the sampler."""
