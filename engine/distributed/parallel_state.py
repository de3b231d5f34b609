"""The process group of one tensor-parallel worker and the only collectives the engine uses.

One process per rank. `init_distributed` joins the group on the device's backend (NCCL on
CUDA, gloo on CPU) and a second gloo group over the same ranks for control bytes, so
that host-side broadcasts (what the scheduler received) never go through NCCL. Every group
has a timeout: a dead or stuck rank makes the others' collectives raise instead of hanging.

Until `init_distributed` runs (and always at TP=1), `get_tp_group()` is a group of one whose
collectives return their input, so the same layers serve TP=1 with no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0
"""How long a collective waits for the other ranks before it raises."""


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in its tensor-parallel group."""

    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None
    """`host:port` of the rendezvous (a TCP store that rank 0 serves); needed when tp_size > 1."""
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size - 1}], got {self.tp_rank}")
        if self.tp_size > 1 and not self.dist_init_addr:
            raise ValueError("tensor parallelism needs dist_init_addr (host:port of rank 0)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class TPGroup:
    """The ranks that hold shards of one model. `all_reduce_calls` counts all-reduces, so a
    test can check the layout's cost (two per layer in a decode step)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
    ):
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.all_reduce_calls = 0

    @property
    def is_first_rank(self) -> bool:
        """Rank 0: the one that talks to the other services."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returned for chaining."""
        if self.size == 1:
            return tensor
        self.all_reduce_calls += 1
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `tensor` (equal shapes), concatenated in rank order along `dim`."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """`data` of rank `src`, on every rank (the others pass None), over the CPU group."""
        if self.size == 1:
            assert data is not None, "a group of one broadcasts its own bytes"
            return data
        if self.rank == src:
            assert data is not None, "the source rank must give the bytes"
        length = torch.tensor([len(data) if data is not None else 0])
        dist.broadcast(length, src=src, group=self.cpu_group)
        size = int(length.item())
        if size == 0:
            return b""
        if self.rank == src:
            assert data is not None
            dist.broadcast(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), src, self.cpu_group
            )
            return data
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=src, group=self.cpu_group)
        return payload.numpy().tobytes()

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value`, over the CPU group: what all ranks can
        afford (e.g. KV pool slots, when their free device memory differs)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)


_TP_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """This process's tensor-parallel group (a group of one before `init_distributed`)."""
    return _TP_GROUP


def init_distributed(config: ParallelConfig, device: torch.device) -> TPGroup:
    """Join the group `config` describes (collective: every rank calls it) and make it the
    one `get_tp_group` returns."""
    global _TP_GROUP
    if config.tp_size == 1:
        _TP_GROUP = TPGroup()
        return _TP_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=config.timeout_s)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.dist_init_addr}",
        world_size=config.tp_size,
        rank=config.tp_rank,
        timeout=timeout,
    )
    world = dist.group.WORLD
    assert world is not None, "init_process_group made the default group"
    # Its own group even over gloo: the scheduler broadcasts on it from its thread while a
    # forward's collectives run on another, and one group's collectives must not interleave.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    _TP_GROUP = TPGroup(config.tp_rank, config.tp_size, world, cpu_group)
    return _TP_GROUP


def destroy_distributed() -> None:
    """Leave the group (if any); `get_tp_group` is a group of one again."""
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TPGroup()
