"""ForwardBatch.from_host: the token-major layout of a batch, and how it reaches the device."""

import pytest
import torch

from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.forward_batch import ForwardBatch, ForwardMode


def ints(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def mixed_batch(device: str) -> ForwardBatch:
    """Two prefills (3 new tokens after 4 cached, 2 after none), then a decode at length 6."""
    return ForwardBatch.from_host(
        ForwardMode.MIXED,
        input_ids=ints(11, 12, 13, 21, 22, 31),
        req_pool_indices=ints(2, 5, 7),
        prefix_lens=ints(4, 0, 5),
        extend_lens=ints(3, 2, 1),
        out_cache_loc=torch.arange(10, 16, device=device),
        req_to_token_pool=ReqToTokenPool(8, 16, device=device),
        token_to_kv_pool=MHATokenToKVPool(32, torch.float32, 1, 4, 1, device=device),
    )


def assert_mixed_layout(batch: ForwardBatch) -> None:
    assert batch.positions.tolist() == [4, 5, 6, 0, 1, 5]
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 31]
    assert batch.req_pool_indices.tolist() == [2, 5, 7]
    assert batch.seq_lens.tolist() == [7, 2, 6]
    assert batch.prefix_lens.tolist() == [4, 0, 5]
    assert batch.extend_lens.tolist() == [3, 2, 1]
    assert (batch.seq_lens_cpu, batch.prefix_lens_cpu, batch.extend_lens_cpu) == (
        [7, 2, 6],
        [4, 0, 5],
        [3, 2, 1],
    )


def test_a_mixed_batch_is_laid_out_token_major_on_cpu() -> None:
    assert_mixed_layout(mixed_batch("cpu"))


def test_a_decode_request_sits_at_its_cached_length() -> None:
    batch = ForwardBatch.from_host(
        ForwardMode.DECODE,
        input_ids=ints(-3, -4),
        req_pool_indices=ints(3, 4),
        prefix_lens=ints(9, 1),
        extend_lens=ints(1, 1),
        out_cache_loc=ints(20, 21),
        req_to_token_pool=ReqToTokenPool(8, 16),
        token_to_kv_pool=MHATokenToKVPool(32, torch.float32, 1, 4, 1),
    )
    assert batch.positions.tolist() == [9, 1]
    assert batch.seq_lens.tolist() == [10, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_host_vectors_travel_in_one_copy() -> None:
    batch = mixed_batch("cuda")
    tensors = [
        batch.input_ids,
        batch.positions,
        batch.req_pool_indices,
        batch.seq_lens,
        batch.prefix_lens,
        batch.extend_lens,
    ]
    assert {t.device.type for t in tensors} == {"cuda"}
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert_mixed_layout(batch)
