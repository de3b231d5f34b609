"""A hybrid model's two pools: the allocator hands out a full and an SWA slot per token
and frees them together or the SWA part alone; the pool routes each layer to its buffers,
translating a sliding layer's full slots; the byte budget splits by the ratio."""

import pytest
import torch

from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem.swa_kv_pool import SWAKVPool


def test_alloc_gives_each_full_slot_an_swa_slot_through_the_mapping():
    allocator = SWATokenToKVPoolAllocator(10, 4)
    full = allocator.alloc(3)
    assert full is not None and sorted(full.tolist()) == sorted(set(full.tolist()))
    swa = allocator.full_to_swa_index_mapping[full]
    assert sorted(swa.tolist()) == sorted(set(swa.tolist())) and swa.min() >= 1
    assert allocator.full_available_size() == 7 and allocator.swa_available_size() == 1
    assert allocator.available_size() == 1
    assert allocator.alloc(2) is None, "the SWA pool is short"
    assert allocator.full_available_size() == 7, "a refused alloc takes nothing from either"


def test_free_returns_both_slots_and_free_swa_only_the_swa_one():
    allocator = SWATokenToKVPoolAllocator(10, 6)
    full = allocator.alloc(6)
    assert full is not None
    allocator.free_swa(full[:4])
    assert allocator.full_to_swa_index_mapping[full[:4]].eq(0).all()
    assert allocator.full_available_size() == 4 and allocator.swa_available_size() == 4
    allocator.free(full)  # the four without an SWA slot free their full slot only
    assert allocator.full_available_size() == 10 and allocator.swa_available_size() == 6
    assert sorted(allocator.swa_free_slots().tolist()) == list(range(1, 7))
    assert allocator.full_to_swa_index_mapping.eq(0).all()


def test_clear_restores_both_pools_and_the_mapping():
    allocator = SWATokenToKVPoolAllocator(5, 5)
    allocator.alloc(5)
    allocator.clear()
    assert allocator.full_available_size() == allocator.swa_available_size() == 5
    assert allocator.full_to_swa_index_mapping.eq(0).all()


def test_sliding_layers_write_at_their_swa_rows_and_full_layers_at_their_slots():
    allocator = SWATokenToKVPoolAllocator(8, 4)
    pool = SWAKVPool(
        8, 4, torch.float32, 2, 3, [True, False, True], allocator.full_to_swa_index_mapping
    )
    assert pool.get_kv_buffer(0)[0].shape[0] == 5 and pool.get_kv_buffer(1)[0].shape[0] == 9
    assert pool.get_kv_buffer(0)[0] is not pool.get_kv_buffer(2)[0]
    assert pool.slot_map(1) is None and pool.slot_map(2) is allocator.full_to_swa_index_mapping
    full = allocator.alloc(2)
    assert full is not None
    k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    for layer_id in range(3):
        pool.set_kv_buffer(layer_id, full, k, v)
    swa_rows = allocator.full_to_swa_index_mapping[full]
    for layer_id, rows in ((0, swa_rows), (1, full), (2, swa_rows)):
        k_buffer, v_buffer = pool.get_kv_buffer(layer_id)
        assert torch.equal(k_buffer[rows], k) and torch.equal(v_buffer[rows], v)


@pytest.mark.parametrize("ratio", [0.1, 0.8, 1.0])
def test_the_split_keeps_the_bytes_of_one_pool_of_every_layer(ratio):
    """Gemma 3 270M's layers: 15 sliding, 3 global."""
    layers = [i % 6 != 5 for i in range(18)]
    full, swa = SWAKVPool.split_tokens(10_000, layers, ratio)
    assert swa == int(full * ratio)
    assert full * 3 + swa * 15 <= 10_000 * 18 < (full + 1) * (3 + 15 * ratio)
    assert full > 10_000 if ratio < 1 else full == 10_000
