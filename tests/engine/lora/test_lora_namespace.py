"""The LoRA adapter as a radix namespace: its place in `extra_keys`, the KV events that
name it as vLLM's `lora_name`, and freeing one adapter's prefixes without touching
another's."""

from __future__ import annotations

import msgpack
import msgspec

from engine.cache.kv_events import BlockEventRecorder, block_hashes
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_key import RadixKey
from engine.sched.req import Admission, Req
from testing.radix import insert_fresh, simulated_cache

BLOCK = 16


def test_lora_joins_the_namespace_after_tenant_and_salt():
    namespace = PrefixNamespace.of(cache_salt="s", tenant="t", lora="a")
    assert namespace is not None
    assert namespace.extra_keys() == (("tenant", "t"), ("cache_salt", "s"), ("lora", "a"))
    assert PrefixNamespace.of() is None
    req = Req("r", [1, 2], admission=Admission(PrefixNamespace(cache_salt="s"), lora_name="a"))
    assert req.admission.extra_key == PrefixNamespace(cache_salt="s", lora="a")


def test_kv_events_carry_the_adapter_as_lora_name():
    cache = simulated_cache(num_slots=200)
    recorder = BlockEventRecorder(BLOCK)
    cache.tree_cache.attach_kv_events(recorder)
    tokens = list(range(100, 132))
    lora = PrefixNamespace(lora="sql")
    insert_fresh(cache, tokens, lora)
    events = msgpack.unpackb(msgspec.msgpack.encode(recorder.take()))
    _, hashes, _, _, _, lora_id, _, lora_name, extra = events[1]
    assert (lora_id, lora_name) == (None, "sql")
    assert extra == [[["lora", "sql"]]] * 2
    assert hashes == block_hashes(tokens, lora) != block_hashes(tokens, None)


def test_evicting_a_namespace_frees_its_prefixes_only():
    cache = simulated_cache(num_slots=200)
    tree = cache.tree_cache
    a, b = PrefixNamespace(lora="a"), PrefixNamespace(lora="b")
    insert_fresh(cache, list(range(10, 40)), a)
    insert_fresh(cache, list(range(10, 25)) + [99, 98], a)  # a branch: two leaves, one parent
    insert_fresh(cache, list(range(10, 40)), b)
    free_before = cache.allocator.available_size()
    assert tree.evict_namespace(a) == 32
    assert cache.allocator.available_size() == free_before + 32
    assert len(tree.match_prefix(RadixKey(list(range(10, 40)), a)).device_indices) == 0
    assert len(tree.match_prefix(RadixKey(list(range(10, 40)), b)).device_indices) == 30
    tree.check_integrity()
