import pytest
import torch

from engine.sched.future_map import FutureMap


def test_futures_resolve_to_the_tokens_stored_under_their_rows():
    fmap = FutureMap(max_running_requests=8, device=torch.device("cpu"))
    rows = torch.tensor([3, 5])
    input_ids = torch.cat([torch.tensor([11, 12, 13]), FutureMap.futures(rows)])
    fmap.store(rows, torch.tensor([101, 102]))
    assert fmap.resolve(input_ids).tolist() == [11, 12, 13, 101, 102]


def test_debug_mode_catches_a_future_read_before_it_is_written_and_a_second_read():
    fmap = FutureMap(max_running_requests=8, device=torch.device("cpu"), debug=True)
    rows = torch.tensor([2])
    with pytest.raises(RuntimeError, match="before it was written"):
        fmap.resolve(FutureMap.futures(rows))
    fmap.store(rows, torch.tensor([7]))
    assert fmap.resolve(FutureMap.futures(rows)).tolist() == [7]
    with pytest.raises(RuntimeError, match="rows \\[2\\]"):
        fmap.resolve(FutureMap.futures(rows))
