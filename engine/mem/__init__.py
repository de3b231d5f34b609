"""KV memory: the two-level page table (request → token slots → per-layer K/V)."""

from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.kv_pool import MHATokenToKVPool
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
from engine.mem.swa_kv_pool import KVPool, SWAKVPool

__all__ = [
    "KVPool",
    "MHATokenToKVPool",
    "ReqToTokenPool",
    "SWAKVPool",
    "SWATokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
]
