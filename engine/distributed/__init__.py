"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on CPU); see
`parallel_state` for the process groups and their collectives."""

from engine.distributed.parallel_state import (
    DEFAULT_INIT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    ParallelConfig,
    TPGroup,
    destroy_distributed,
    get_tp_group,
    init_distributed,
)

__all__ = [
    "DEFAULT_INIT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "ParallelConfig",
    "TPGroup",
    "destroy_distributed",
    "get_tp_group",
    "init_distributed",
]
