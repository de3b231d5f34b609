import pytest
import torch

from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_allocator_never_hands_out_the_padding_slot_and_returns_none_when_short(device):
    allocator = TokenToKVPoolAllocator(10, device)
    first = allocator.alloc(4)
    rest = allocator.alloc(6)
    assert first.device.type == device and first.dtype == torch.int64
    assert sorted(torch.cat([first, rest]).tolist()) == list(range(1, 11))
    assert allocator.available_size() == 0
    assert allocator.alloc(1) is None


@pytest.mark.parametrize("device", DEVICES)
def test_allocator_free_makes_slots_reusable_and_clear_restores_everything(device):
    allocator = TokenToKVPoolAllocator(8, device)
    slots = allocator.alloc(8)
    allocator.free(slots[2:5])
    assert allocator.available_size() == 3
    assert sorted(allocator.alloc(3).tolist()) == slots[2:5].tolist()
    allocator.free(torch.empty(0, dtype=torch.int64, device=device))
    assert allocator.available_size() == 0
    allocator.clear()
    assert allocator.available_size() == 8


def test_allocator_rejects_an_empty_pool():
    with pytest.raises(ValueError, match="size"):
        TokenToKVPoolAllocator(0)


@pytest.mark.parametrize("device", DEVICES)
def test_req_to_token_pool_rows_skip_the_padding_row(device):
    pool = ReqToTokenPool(3, 16, device)
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert sorted(rows) == [1, 2, 3]
    assert pool.alloc(1) is None
    pool.free(rows[0])
    assert pool.alloc(1) == [rows[0]]
    pool.clear()
    assert pool.available_size() == 3


@pytest.mark.parametrize("device", DEVICES)
def test_req_to_token_pool_write_points_tokens_at_slots(device):
    pool = ReqToTokenPool(2, 8, device)
    (row,) = pool.alloc(1)
    pool.write(row, 2, torch.tensor([7, 8, 9], device=device))
    assert pool.req_to_token[row, :5].tolist() == [0, 0, 7, 8, 9]
    with pytest.raises(ValueError, match="max_context_len"):
        pool.write(row, 6, torch.tensor([1, 2, 3], device=device))


def test_req_to_token_pool_rejects_freeing_a_foreign_row():
    pool = ReqToTokenPool(2, 8)
    with pytest.raises(ValueError, match="row 0"):
        pool.free(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pool_stores_and_returns_per_layer_kv_at_slots(device, dtype):
    pool = MHATokenToKVPool(
        size=16, dtype=dtype, head_num=2, head_dim=4, layer_num=3, device=device
    )
    assert pool.k_buffer[0].shape == (17, 2, 4)
    loc = torch.tensor([3, 9, 1], device=device)
    k = torch.randn(3, 2, 4, device=device)
    v = torch.randn(3, 2, 4, device=device)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.k_buffer[1][loc], k.to(dtype))
    assert torch.equal(pool.v_buffer[1][loc], v.to(dtype))
    assert not pool.k_buffer[0].any() and not pool.k_buffer[2].any()
    assert not pool.k_buffer[1][0].any()


def test_kv_pool_budget_counts_k_and_v_of_every_layer():
    cell = MHATokenToKVPool.cell_size(head_num=3, head_dim=64, layer_num=30, dtype=torch.bfloat16)
    assert cell == 2 * 30 * 3 * 64 * 2
    assert MHATokenToKVPool.max_tokens_for_budget(cell * 1001, 3, 64, 30, torch.bfloat16) == 1000


def test_allocated_slots_do_not_pin_the_free_list_and_freed_slots_come_back_last():
    allocator = TokenToKVPoolAllocator(6)
    slots = allocator.alloc(2)
    assert slots.untyped_storage().data_ptr() != allocator.free_slots().untyped_storage().data_ptr()
    allocator.free(slots)
    assert allocator.available_size() == 6
    assert allocator.free_slots().tolist() == [3, 4, 5, 6, 1, 2]
    assert allocator.alloc(6).tolist() == [3, 4, 5, 6, 1, 2]
