"""The radix tree published as KV-cache events: decoded with a plain msgpack decoder, in
vLLM's array layout, and replayed in order they give exactly the tree's full 16-token
blocks — after inserts, splits, evictions, retraction and a flush."""

from __future__ import annotations

import hashlib
import random

import msgpack
import msgspec
import pytest

from benchmarks.support.kv_events import apply_events
from benchmarks.support.radix import insert_fresh, simulated_cache
from engine.cache.kv_events import BlockEventRecorder, EventBatch, block_hash, block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Req

BLOCK = 16
SALT = PrefixNamespace(cache_salt="tenant-a")


def wire(events: list) -> list[list]:
    """Events as a router decodes them: msgpack with no schema."""
    return msgpack.unpackb(msgspec.msgpack.encode(events))


def tree_blocks(tree: RadixCache, block_size: int = BLOCK) -> set[int]:
    """Every full block on every root→node path of the tree, hashed from its tokens."""
    blocks: set[int] = set()
    paths = {tree.root_node: []}
    for node in tree._nodes():  # parents before children
        path = paths[node.parent] + node.key.tolist()
        paths[node] = path
        blocks.update(block_hashes(path, node.key.extra_key, block_size))
    return blocks


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
    assert blocks == tree_blocks(cache.tree_cache) and len(blocks) == 3  # block 0 shared

    cache.tree_cache.evict(20)  # one 20-token leaf: tokens 20..39 of its path
    apply_events(wire(recorder.take()), blocks)
    assert blocks == tree_blocks(cache.tree_cache) and len(blocks) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_replayed_events_equal_the_tree_after_every_turn_under_retraction_and_flush(
    make_engine, overlap
):
    engine = make_engine(
        max_total_tokens=600,
        chunked_prefill_size=48,
        max_running_requests=12,
        disable_overlap_schedule=not overlap,
    )
    scheduler = engine.scheduler
    tree = scheduler.cache_manager.tree_cache
    recorder = BlockEventRecorder(BLOCK)
    tree.attach_kv_events(recorder)
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 256) for _ in range(40)] for _ in range(3)]
    for i in range(18):
        prompt = prefixes[i % 3] + [rng.randrange(3, 256) for _ in range(rng.randint(5, 30))]
        scheduler.add_request(
            Req(
                f"r{i}",
                prompt,
                SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True),
                extra_key=SALT if i % 2 else None,
            )
        )
    published: set[int] = set()
    turns = 0

    def after_turn(_outputs: list[Req]) -> None:
        nonlocal turns
        apply_events(wire(recorder.take()), published)
        assert published == tree_blocks(tree), f"turn {turns}"
        turns += 1

    scheduler.run_event_loop(lambda: not scheduler.has_work(), send_outputs=after_turn)
    scheduler.run_event_loop(lambda: scheduler.in_flight is None, send_outputs=after_turn)
    assert scheduler.stats.num_retractions > 0 and tree.evicted_tokens > 0
    assert published and turns > 10

    scheduler.cache_manager.reset()  # what /flush_cache does
    events = wire(recorder.take())
    assert events == [["AllBlocksCleared"]]
    apply_events(events, published)
    assert published == tree_blocks(tree) == set()
