"""Sampling: per-request parameters, their batched tensors, penalties and the sampler."""

from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingBatchInfo", "SamplingParams"]
