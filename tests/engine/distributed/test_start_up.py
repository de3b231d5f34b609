"""Forming the tensor-parallel group: start-up waits for slow ranks up to the start-up
timeout, however far past the group's collective timeout, and fails naming a rank that
never joins or that died; once serving, the group timeout applies. Both timeouts are set
small here so that the late ranks are seconds late, not minutes."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.args import EngineArgs
from engine.distributed import ParallelConfig, destroy_distributed, get_tp_group, init_distributed
from engine.distributed.tp_ranks import RankProcesses
from testing.net import free_port

GROUP_TIMEOUT_S = 0.5
"""The collectives' timeout once serving: the late rank below is later than it."""
LATE_S = 2.5
"""How late rank 1 is: to join (importing torch), to load, and once serving."""
CPU = torch.device("cpu")


def _late_rank(rank: int, addr: str, results: Any) -> None:
    if rank == 1:
        time.sleep(LATE_S)  # importing torch on a busy host
    config = ParallelConfig(2, rank, addr, timeout_s=GROUP_TIMEOUT_S, init_timeout_s=120)
    group = init_distributed(config, CPU)
    try:
        if rank == 1:
            time.sleep(LATE_S)  # loading its shard, while rank 0 waits in the KV pool's min
        results[(rank, "min")] = group.min_over_ranks(10 + rank)
        group.start_serving()
        results[(rank, "sum")] = group.all_reduce(torch.ones(1)).item()
        if rank == 1:
            time.sleep(LATE_S)  # serving, a rank this late is stuck
        try:
            group.barrier()
            results[(rank, "late")] = "waited"
        except RuntimeError as err:
            results[(rank, "late")] = str(err)
    finally:
        destroy_distributed()


@pytest.mark.timeout(120)
def test_a_rank_later_than_the_group_timeout_to_join_and_load_still_forms_the_group():
    results = mp.Manager().dict()
    mp.spawn(_late_rank, args=(f"127.0.0.1:{free_port()}", results), nprocs=2, join=True)
    for rank in (0, 1):
        assert results[(rank, "min")] == 10
        assert results[(rank, "sum")] == 2.0
    # Serving, rank 0 gave up on the stuck rank 1 after the group timeout.
    assert "timed out" in results[(0, "late")].lower(), results[(0, "late")]


def test_a_rank_that_never_joins_fails_the_start_naming_it():
    config = ParallelConfig(3, 0, f"127.0.0.1:{free_port()}", init_timeout_s=1)
    with pytest.raises(
        TimeoutError,
        match=r"rank\(s\) 1, 2 of 3 did not join the group at 127\.0\.0\.1:\d+ within the "
        r"start-up timeout of 1 s \(dist_init_timeout\)",
    ):
        init_distributed(config, CPU)
    assert get_tp_group().size == 1 and not dist.is_initialized()


def _exit_before_joining(args: EngineArgs, rank: int, addr: str) -> None:
    os._exit(3)


@pytest.mark.timeout(120)
def test_a_spawned_rank_that_dies_before_joining_fails_the_start_at_once_naming_it():
    """The start-up timeout is long: the error comes from the dead child, not from it."""
    addr = f"127.0.0.1:{free_port()}"
    ranks = RankProcesses(EngineArgs(tp_size=2, device="cpu"), addr, _exit_before_joining)
    try:
        with pytest.raises(
            RuntimeError,
            match=r"tensor-parallel rank 1 \(pid \d+\) exited with status 3 before joining",
        ):
            init_distributed(ParallelConfig(2, 0, addr, init_timeout_s=600), CPU, ranks.check)
    finally:
        ranks.kill()
        destroy_distributed()
    assert get_tp_group().size == 1
