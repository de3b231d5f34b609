"""The one owner of requests' KV: their rows of `req_to_token`, their slots, and their
locks on the prefix cache.

A request's row maps its tokens to KV slots in two parts:
- `[0, len(prefix_indices))`: slots the prefix cache holds, pinned by the lock on `last_node`
  (the cache's handle of the match);
- `[len(prefix_indices), allocated_len)`: slots the request owns and must free.

Every write to a request's `KVState` (`req.kv`: `req_pool_idx`, `prefix_indices`,
`last_node`, `allocated_len`, `committed_len`) happens here, so the slot accounting that
`check_integrity` proves has one place to go wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Self

import torch

from engine.cache.base_prefix_cache import BasePrefixCache, check_invariant
from engine.cache.chunk_cache import ChunkCache
from engine.cache.radix_cache import RadixCache
from engine.cache.radix_key import RadixKey
from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.model.forward_batch import ForwardBatch
from engine.sched.req import Req

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner


class CacheManager:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        tree_cache: BasePrefixCache,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache

    @classmethod
    def over_pools(cls, runner: ModelRunner, radix_cache: bool, eviction_policy: str) -> Self:
        """Over a model runner's pools, with a radix tree (`eviction_policy` its order) or,
        with the radix cache off, a cache that keeps nothing."""
        allocator = runner.token_to_kv_pool_allocator
        tree_cache: BasePrefixCache = (
            RadixCache(allocator, eviction_policy) if radix_cache else ChunkCache(allocator.device)
        )
        return cls(runner.req_to_token_pool, allocator, tree_cache)

    # ----- admission --------------------------------------------------------------------

    def match_req(self, req: Req) -> None:
        """Match a waiting request against the cache (SGLang's `init_next_round_input`), at
        most `req.max_prefix_len` tokens: the last token is always recomputed, and so are the
        positions whose logits its pending prompt logprobs need."""
        fill_ids = req.all_token_ids()
        req.kv.prefix_indices, req.kv.last_node = self.tree_cache.match_prefix(
            RadixKey(fill_ids[: req.max_prefix_len], req.admission.extra_key)
        )
        req.prefill.extend_input_len = len(fill_ids) - len(req.kv.prefix_indices)

    def lock(self, req: Req) -> None:
        """Pin the request's matched prefix: locked slots are never evicted."""
        if req.kv.last_node is not None:
            self.tree_cache.inc_lock_ref(req.kv.last_node)

    def unlock(self, req: Req) -> None:
        if req.kv.last_node is not None:
            self.tree_cache.dec_lock_ref(req.kv.last_node)

    # ----- allocation -------------------------------------------------------------------

    def alloc_row(self, req: Req) -> None:
        """Give a newly admitted request its row, starting with its locked prefix."""
        rows = self.req_to_token_pool.alloc(1)
        if rows is None:
            raise RuntimeError(
                "no free request row — admission let more requests run than --max-running-requests"
            )
        (req.kv.req_pool_idx,) = rows
        self.req_to_token_pool.write(req.kv.req_pool_idx, 0, req.kv.prefix_indices)
        req.kv.allocated_len = req.kv.committed_len = len(req.kv.prefix_indices)

    def make_room(self, num_tokens: int) -> bool:
        """Evict cache until `num_tokens` slots are free; True if they are."""
        shortfall = num_tokens - self.allocator.available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)
        return self.allocator.available_size() >= num_tokens

    def alloc_slots(self, num_tokens: int) -> torch.Tensor:
        """Take slots, evicting cache first when the free list alone is short. Admission and
        the decode memory check guarantee they exist, so a shortfall is a scheduler bug."""
        self.make_room(num_tokens)
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            raise RuntimeError(
                f"KV pool exhausted: {num_tokens} slots needed, "
                f"{self.allocator.available_size()} free and "
                f"{self.tree_cache.evictable_size()} evictable — admission control let a "
                "batch through that does not fit"
            )
        return slots

    def assign_slots(self, reqs: list[Req], forward_batch: ForwardBatch) -> None:
        """Point each new token's entry of its request's row at its slot of
        `forward_batch.out_cache_loc`, in one indexed write (no per-request op)."""
        out_cache_loc = forward_batch.out_cache_loc
        if forward_batch.forward_mode.is_decode():
            token_rows = forward_batch.req_pool_indices
        else:
            token_rows = torch.repeat_interleave(
                forward_batch.req_pool_indices,
                forward_batch.extend_lens,
                output_size=len(out_cache_loc),
            )
        self.req_to_token_pool.req_to_token[token_rows, forward_batch.positions] = out_cache_loc.to(
            torch.int32
        )
        if forward_batch.forward_mode.is_decode():
            for req in reqs:
                req.kv.allocated_len += 1
        else:
            for req, extend_len in zip(reqs, forward_batch.extend_lens_cpu):
                req.kv.allocated_len += extend_len

    def keep_verified(self, req: Req, slots: torch.Tensor) -> None:
        """A verify pass wrote K/V for the request's accepted path, root first, at `slots`:
        they become its next positions, written and committed (no copy: the row points at
        them where the pass wrote them)."""
        start = req.kv.allocated_len
        self.req_to_token_pool.write(req_row(req), start, slots)
        req.kv.allocated_len = start + len(slots)
        req.kv.committed_len += len(slots)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return slots no request or cache holds: a verify pass's rejected drafts."""
        self.allocator.free(slots)

    def commit(self, req: Req, num_tokens: int) -> None:
        """The forward pass wrote K/V for the request's next `num_tokens` allocated slots."""
        req.kv.committed_len += num_tokens

    # ----- handing KV to the cache, and freeing it --------------------------------------

    def cache_unfinished_req(self, req: Req, chunked: bool = True) -> None:
        """Insert a running request's committed KV so others can share it mid-flight.

        Duplicate slots are freed and the request's row is repointed at the cache's copy,
        so one prefix has one copy; the request then locks its new, longer prefix.
        """
        row = req_row(req)
        kv_len = req.kv.committed_len
        indices = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        key = RadixKey(req.all_token_ids()[:kv_len], req.admission.extra_key)
        owned_from = len(req.kv.prefix_indices)
        inserted = self.tree_cache.insert(key, indices, req.admission.priority, chunked=chunked)
        self.allocator.free(indices[owned_from : inserted.prefix_len])
        new_indices, new_last_node = self.tree_cache.match_prefix(key)
        self.req_to_token_pool.write(row, owned_from, new_indices[owned_from:])
        self.tree_cache.inc_lock_ref(new_last_node)
        self.unlock(req)
        req.kv.prefix_indices, req.kv.last_node = new_indices, new_last_node

    def cache_finished_req(self, req: Req) -> None:
        """Hand a finished request's KV to the cache and release its row.

        The request's committed tokens (input + output[:-1]: the last sampled token was
        never forwarded, so it has no KV) are offered to the cache; slots duplicating what
        it already held are freed at once, as are slots it does not keep and slots
        allocated but never written.
        """
        indices = self._row_slots(req)
        kv_len = req.kv.committed_len
        key = RadixKey(req.all_token_ids()[:kv_len], req.admission.extra_key)
        inserted = self.tree_cache.insert(key, indices[:kv_len], req.admission.priority)
        self.allocator.free(indices[len(req.kv.prefix_indices) : inserted.prefix_len])
        self.allocator.free(indices[inserted.kept_len :])
        self._release(req)

    def free_req(self, req: Req) -> None:
        """Free every slot the request owns without caching any (retraction, abort), unlock
        its prefix and release its row."""
        self.allocator.free(self._row_slots(req)[len(req.kv.prefix_indices) :])
        self._release(req)

    def _row_slots(self, req: Req) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req_row(req), : req.kv.allocated_len].to(
            torch.int64
        )

    def _release(self, req: Req) -> None:
        self.unlock(req)
        self.req_to_token_pool.free(req_row(req))
        req.kv.req_pool_idx = None
        req.kv.last_node = None
        req.kv.prefix_indices = torch.empty(0, dtype=torch.int64, device=self.allocator.device)
        req.kv.allocated_len = req.kv.committed_len = 0

    def reset(self) -> None:
        """Empty the cache and both pools. Only while no request holds KV."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    # ----- integrity --------------------------------------------------------------------

    def check_integrity(self, reqs: Iterable[Req] = ()) -> None:
        """Raise AssertionError unless the cache, the pools and the given running requests
        agree: the cache's own check passes; every KV slot 1..size is accounted exactly once
        among the allocator's free list, the cache, and the slots the requests own; each
        request's row starts with its prefix, which is locked and is its last node's path."""
        self.tree_cache.check_integrity()
        table = self.req_to_token_pool.req_to_token
        free_rows = set(self.req_to_token_pool.free_slots)
        slots = [self.allocator.free_slots(), self.tree_cache.cached_slots()]
        for req in reqs:
            row = req.kv.req_pool_idx
            if row is None or row in free_rows:
                raise AssertionError(f"request {req.rid} has no allocated row")
            prefix_len = len(req.kv.prefix_indices)
            held = table[row, : req.kv.allocated_len].to(torch.int64)
            check_invariant(
                torch.equal(held[:prefix_len].cpu(), req.kv.prefix_indices.cpu()),
                f"request {req.rid}: row != prefix",
            )
            if prefix_len:
                last_node = req.kv.last_node
                check_invariant(
                    last_node is not None and last_node.lock_ref > 0,
                    f"request {req.rid}: prefix unlocked",
                )
                check_invariant(
                    last_node is not None
                    and torch.equal(last_node.matched_indices().cpu(), req.kv.prefix_indices.cpu()),
                    f"request {req.rid}: prefix is not its last_node's match",
                )
            slots.append(held[prefix_len:])

        counts = Counter(torch.cat(slots).tolist())
        expected = set(range(1, self.allocator.size + 1))
        check_invariant(
            set(counts) == expected,
            f"slots unaccounted: {sorted(expected - set(counts))[:10]}"
            f", foreign: {sorted(set(counts) - expected)[:10]}",
        )
        check_invariant(
            max(counts.values(), default=1) == 1,
            f"slots held twice: {[s for s, c in counts.items() if c > 1][:10]}",
        )


def req_row(req: Req) -> int:
    """The request's row of `req_to_token`, which it must hold."""
    if req.kv.req_pool_idx is None:
        raise RuntimeError(f"request {req.rid} holds no row")
    return req.kv.req_pool_idx
