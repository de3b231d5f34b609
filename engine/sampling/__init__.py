"""Sampling: per-request parameters, their batched tensors, penalties and the sampler.

Nothing is re-exported here: `sampling_params` must stay importable without torch, for the
tokenizer and detokenizer processes."""
