"""The radix tree recorded as KV-cache events, decoded with a plain msgpack decoder: vLLM's
array layout, the hash definition, the salt, and what splits and evictions publish. The
whole scheduler through the real publisher is in tests/services/test_kv_events_wire.py;
the stateful property test checks the replay against a brute-force model."""

from __future__ import annotations

import hashlib

import msgpack
import msgspec

from engine.cache.kv_events import BlockEventRecorder, EventBatch, block_hash, block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey
from testing.kv_events import apply_events
from testing.radix import insert_fresh, simulated_cache, tree_blocks

BLOCK = 16
SALT = PrefixNamespace(cache_salt="tenant-a")


def wire(events: list) -> list[list]:
    """Events as a router decodes them: msgpack with no schema."""
    return msgpack.unpackb(msgspec.msgpack.encode(events))


def recorded_cache(num_slots: int = 400) -> tuple:
    cache = simulated_cache(num_slots=num_slots)
    recorder = BlockEventRecorder(BLOCK)
    cache.tree_cache.attach_kv_events(recorder)
    return cache, recorder


def test_the_hash_is_sha256_of_the_msgpack_triple_cut_to_a_big_endian_uint64():
    tokens = list(range(16))
    digest = hashlib.sha256(msgpack.packb([None, tokens, [["cache_salt", "x"]]])).digest()
    assert block_hash(None, tokens, [("cache_salt", "x")]) == int.from_bytes(digest[:8], "big")
    first = block_hash(None, tokens, [])
    second = block_hash(first, tokens, [])
    assert block_hashes(tokens * 2 + [7], None) == [first, second]  # the partial block has none
    assert 0 <= second < 2**64 and first != second


def test_a_stored_chain_has_vllms_array_layout_and_carries_its_salt():
    cache, recorder = recorded_cache()
    tokens = list(range(100, 140))
    insert_fresh(cache, tokens, SALT)
    batch = msgpack.unpackb(msgspec.msgpack.encode(EventBatch(12.5, recorder.take())))

    ts, events, dp_rank = batch
    assert (ts, dp_rank) == (12.5, 0)
    assert events[0] == ["AllBlocksCleared"]  # attach = start-up
    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra = events[1]
    assert (tag, parent, block_size, lora_id, medium, lora_name) == (
        "BlockStored",
        None,
        16,
        None,
        "GPU",
        None,
    )
    assert token_ids == tokens[:32]  # two full blocks; the last 8 tokens make none
    assert hashes == block_hashes(tokens, SALT)
    assert extra == [[["cache_salt", "tenant-a"]]] * 2
    assert hashes != block_hashes(tokens, None)  # the salt is in the hash, not beside it


def test_a_split_publishes_nothing_and_a_branch_chains_from_the_shared_block():
    cache, recorder = recorded_cache()
    shared = list(range(20))
    a, b = shared + [1] * 20, shared + [2] * 20
    insert_fresh(cache, a)
    recorder.take()
    cache.tree_cache.match_prefix(RadixKey(shared[:10]))  # splits an edge mid-block
    assert recorder.take() == []
    insert_fresh(cache, b)
    (stored,) = wire(recorder.take())
    assert stored[2] == block_hashes(a, None)[0]  # parent: the block both paths share
    assert stored[1] == block_hashes(b, None)[1:]
    assert stored[3] == b[16:32]  # the branch's block starts before the branch point


def test_evicting_a_leaf_removes_the_block_it_cut_into_and_keeps_the_one_above():
    cache, recorder = recorded_cache()
    shared = list(range(20))
    insert_fresh(cache, shared + [1] * 20)
    insert_fresh(cache, shared + [2] * 20)
    blocks: set[int] = set()
    apply_events(wire(recorder.take()), blocks)
    assert blocks == tree_blocks(cache.tree_cache, BLOCK) and len(blocks) == 3  # block 0 shared

    cache.tree_cache.evict(20)  # one 20-token leaf: tokens 20..39 of its path
    apply_events(wire(recorder.take()), blocks)
    assert blocks == tree_blocks(cache.tree_cache, BLOCK) and len(blocks) == 2


def test_a_hybrid_models_tree_publishes_its_full_kv_and_no_removal_for_a_tombstone():
    """With two pools (a window of 4) the blocks are the tree's full KV: an insert stores
    its full blocks, though it drops at once the SWA KV of all but its last 3 tokens;
    dropping those too (every node an SWA tombstone) publishes nothing, as the full KV
    stays; a full eviction removes the blocks."""
    cache = simulated_cache(num_slots=400, swa_slots=100, sliding_window=4)
    tree, recorder = cache.tree_cache, BlockEventRecorder(BLOCK)
    tree.attach_kv_events(recorder)
    tokens = list(range(100, 140))
    insert_fresh(cache, tokens)
    blocks: set[int] = set()
    apply_events(wire(recorder.take()), blocks)
    assert blocks == set(block_hashes(tokens, None)) == tree_blocks(tree, BLOCK)
    assert len(blocks) == 2 and len(tree.cached_swa_slots()) == 3

    assert tree.evict_swa(3) == 3 and len(tree.cached_swa_slots()) == 0
    assert recorder.take() == []
    cache.check_integrity()

    tree.evict(len(tokens))
    apply_events(wire(recorder.take()), blocks)
    assert blocks == set() == tree_blocks(tree, BLOCK)
    cache.check_integrity()
