"""The tensor-parallel group over gloo, with two real processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from engine.distributed import ParallelConfig, destroy_distributed, get_tp_group, init_distributed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _collectives(rank: int, addr: str, results: dict) -> None:
    group = init_distributed(ParallelConfig(2, rank, addr, timeout_s=30), torch.device("cpu"))
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            summed = group.all_reduce(torch.full((3,), rank + 1.0, dtype=dtype))
            gathered = group.all_gather(torch.full((2, 1), float(rank), dtype=dtype), dim=-1)
            results[(rank, str(dtype))] = (summed.tolist(), gathered.tolist())
        results[(rank, "bytes")] = group.broadcast_bytes(b"from rank 0" if rank == 0 else None)
        results[(rank, "empty")] = group.broadcast_bytes(b"" if rank == 0 else None)
        results[(rank, "calls")] = group.all_reduce_calls
    finally:
        destroy_distributed()


def test_two_ranks_sum_gather_and_broadcast_bytes():
    results = mp.Manager().dict()
    addr = f"127.0.0.1:{free_port()}"
    mp.spawn(_collectives, args=(addr, results), nprocs=2, join=True)
    for rank in (0, 1):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            summed, gathered = results[(rank, str(dtype))]
            assert summed == [3.0, 3.0, 3.0]
            assert gathered == [[0.0, 1.0], [0.0, 1.0]]
        assert results[(rank, "bytes")] == b"from rank 0"
        assert results[(rank, "empty")] == b""
        assert results[(rank, "calls")] == 3


def test_a_group_of_one_needs_no_process_group():
    group = get_tp_group()
    tensor = torch.ones(2)
    assert group.size == 1 and group.is_first_rank
    assert group.all_reduce(tensor) is tensor and group.all_gather(tensor) is tensor
    assert group.broadcast_bytes(b"x") == b"x" and group.all_reduce_calls == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(tp_size=0), "tp_size must be >= 1"),
        (dict(tp_size=2, tp_rank=2, dist_init_addr="h:1"), "tp_rank must be in"),
        (dict(tp_size=2, tp_rank=0), "needs dist_init_addr"),
    ],
)
def test_a_bad_parallel_config_is_refused(config: dict, message: str):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**config)
