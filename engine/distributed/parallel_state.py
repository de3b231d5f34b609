"""The process group of one tensor-parallel worker and the only collectives the engine uses.

One process per rank. `init_distributed` joins the group on the device's backend (NCCL on
CUDA, gloo on CPU) and a second gloo group over the same ranks for control bytes, so
that host-side broadcasts (what the scheduler received) never go through NCCL. Every group
has a timeout: a dead or stuck rank makes the others' collectives raise instead of hanging.

Two timeouts, because starting and serving differ: a rank may need minutes to import torch
and load its shard on a busy host, while a served collective that waits a minute means a
rank is dead or stuck. So the ranks meet at a TCP store first, each waiting (polled, so
that a caller can check its spawned ranks meanwhile) up to the start-up timeout for all to
arrive; the groups then keep that timeout through loading, until `TPGroup.start_serving`
(every rank calls it once built) holds their collectives to the group timeout.

Until `init_distributed` runs (and always at TP=1), `get_tp_group()` is a group of one whose
collectives return their input, so the same layers serve TP=1 with no process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from engine.args import EngineArgs

DEFAULT_TIMEOUT_S = 60.0
"""How long a collective waits for the other ranks once the group serves, before it raises."""
DEFAULT_INIT_TIMEOUT_S: float = EngineArgs.dist_init_timeout
"""How long start-up waits for the other ranks to join and load (torch's own default for
gloo groups): generous, since a local rank that dies is reported at once (`waiting`)."""
JOIN_POLL_S = 0.2
"""How often a rank waiting for the others to join checks on them."""


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in its tensor-parallel group."""

    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None
    """`host:port` of the rendezvous (a TCP store that rank 0 serves); needed when tp_size > 1."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """How long a collective waits once the group serves."""
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S
    """How long start-up waits: for every rank to join, then in collectives until
    `start_serving`."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size - 1}], got {self.tp_rank}")
        if self.tp_size > 1 and not self.dist_init_addr:
            raise ValueError("tensor parallelism needs dist_init_addr (host:port of rank 0)")
        for name in ("timeout_s", "init_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class TPGroup:
    """The ranks that hold shards of one model. `all_reduce_calls` counts all-reduces, so a
    test can check the layout's cost (two per layer in a decode step)."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.rank = rank
        self.size = size
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.timeout_s = timeout_s
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

    def start_serving(self) -> None:
        """Wait (still under the start-up timeout) until every rank has built its engine,
        then hold every collective to the group timeout: from here a late rank is a dead
        or stuck one (collective: every rank calls it once, after its last start-up
        collective)."""
        if self.size == 1:
            return
        self.barrier()
        timeout = timedelta(seconds=self.timeout_s)
        for group in (self.device_group, self.cpu_group):
            distributed_c10d._set_pg_timeout(timeout, group)


_TP_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """This process's tensor-parallel group (a group of one before `init_distributed`)."""
    return _TP_GROUP


def init_distributed(
    config: ParallelConfig, device: torch.device, waiting: Callable[[], None] | None = None
) -> TPGroup:
    """Join the group `config` describes (collective: every rank calls it) and make it the
    one `get_tp_group` returns. Waits up to `config.init_timeout_s` for every rank to join,
    calling `waiting` meanwhile (it raises to give up, e.g. when a spawned rank died); a
    rank that has not joined by then fails the start, named. The groups keep the start-up
    timeout until `TPGroup.start_serving`."""
    global _TP_GROUP
    if config.tp_size == 1:
        _TP_GROUP = TPGroup()
        return _TP_GROUP
    assert config.dist_init_addr is not None, "ParallelConfig checks it at TP > 1"
    backend = "nccl" if device.type == "cuda" else "gloo"
    init_timeout = timedelta(seconds=config.init_timeout_s)
    host, _, port = config.dist_init_addr.rpartition(":")
    # Rank 0 serves the store without waiting for the others (which is what
    # init_process_group's tcp:// does, blind, under the collectives' timeout): the
    # ranks wait below, where a caller can look at them.
    store = dist.TCPStore(
        host,
        int(port),
        config.tp_size,
        is_master=config.tp_rank == 0,
        timeout=init_timeout,
        wait_for_workers=False,
    )
    store.set(_joined_key(config.tp_rank), "1")
    _await_ranks(store, config, waiting)
    dist.init_process_group(
        backend,
        store=store,
        world_size=config.tp_size,
        rank=config.tp_rank,
        timeout=init_timeout,
    )
    world = dist.group.WORLD
    assert world is not None, "init_process_group made the default group"
    # Its own group even over gloo: the scheduler broadcasts on it from its thread while a
    # forward's collectives run on another, and one group's collectives must not interleave.
    cpu_group = dist.new_group(backend="gloo", timeout=init_timeout)
    _TP_GROUP = TPGroup(config.tp_rank, config.tp_size, world, cpu_group, config.timeout_s)
    return _TP_GROUP


def _joined_key(rank: int) -> str:
    return f"radixserve/joined/{rank}"


def _await_ranks(
    store: dist.Store, config: ParallelConfig, waiting: Callable[[], None] | None
) -> None:
    """Return once every rank has joined `store`; raise naming those that did not within
    the start-up timeout."""
    deadline = time.monotonic() + config.init_timeout_s
    missing = list(range(config.tp_size))
    while True:
        missing = [rank for rank in missing if not store.check([_joined_key(rank)])]
        if not missing:
            return
        if waiting is not None:
            waiting()
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(map(str, missing))
            raise TimeoutError(
                f"tensor-parallel rank(s) {names} of {config.tp_size} did not join the group "
                f"at {config.dist_init_addr} within the start-up timeout of "
                f"{config.init_timeout_s:g} s (dist_init_timeout)"
            )
        time.sleep(min(JOIN_POLL_S, left))


def destroy_distributed() -> None:
    """Leave the group (if any); `get_tp_group` is a group of one again."""
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TPGroup()
