"""The one owner of requests' KV: their rows of `req_to_token`, their slots, and their
locks on the prefix cache.

A request's row maps its tokens to KV slots in two parts:
- `[0, len(prefix_indices))`: slots the prefix cache holds, pinned by the lock on `last_node`
  (the cache's handle of the match);
- `[len(prefix_indices), allocated_len)`: slots the request owns and must free.

Every write to a request's `KVState` (`req.kv`: `req_pool_idx`, `prefix_indices`,
`last_node`, `allocated_len`, `committed_len`, `swa_evicted_len`) happens here, so the slot
accounting that `check_integrity` proves has one place to go wrong.

A hybrid model's (`SWATokenToKVPoolAllocator`) request also frees, as it moves on, the SWA
slots of its own tokens that no query of its will see again (`free_out_of_window`).
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
from engine.cache.swa_radix_cache import SWARadixCache
from engine.constants import SWA_EVICTION_INTERVAL
from engine.mem.allocator import TokenToKVPoolAllocator
from engine.mem.req_to_token_pool import ReqToTokenPool
from engine.mem.swa_allocator import SWATokenToKVPoolAllocator
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
        sliding_window: int | None = None,
    ) -> None:
        """`sliding_window`: a hybrid model's window, with an `SWATokenToKVPoolAllocator`."""
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.tree_cache = tree_cache
        self.swa_allocator: SWATokenToKVPoolAllocator | None = None
        self.sliding_window = sliding_window
        if isinstance(token_to_kv_pool_allocator, SWATokenToKVPoolAllocator):
            if sliding_window is None:
                raise ValueError("two KV pools serve a model with a sliding window")
            self.swa_allocator = token_to_kv_pool_allocator

    @classmethod
    def over_pools(
        cls,
        runner: ModelRunner,
        radix_cache: bool,
        eviction_policy: str,
        window_checkpoints: bool = True,
    ) -> Self:
        """Over a model runner's pools, with a radix tree (`eviction_policy` its order; over
        a hybrid model's two pools, one that knows windows, `window_checkpoints` as
        `SWARadixCache` takes it) or, with the radix cache off, a cache that keeps nothing."""
        allocator = runner.token_to_kv_pool_allocator
        window = None if runner.swa_layers is None else runner.model_config.sliding_window
        tree_cache: BasePrefixCache
        if not radix_cache:
            tree_cache = ChunkCache(allocator.device)
        elif isinstance(allocator, SWATokenToKVPoolAllocator) and window is not None:
            tree_cache = SWARadixCache(allocator, window, eviction_policy, window_checkpoints)
        else:
            tree_cache = RadixCache(allocator, eviction_policy)
        return cls(runner.req_to_token_pool, allocator, tree_cache, window)

    # ----- admission --------------------------------------------------------------------

    def match_req(self, req: Req) -> None:
        """Match a waiting request against the cache (SGLang's `init_next_round_input`), at
        most `req.max_prefix_len` tokens: the last token is always recomputed, and so are the
        positions whose logits its pending prompt logprobs need."""
        fill_ids = req.all_token_ids()
        match = self.tree_cache.match_prefix(
            RadixKey(fill_ids[: req.max_prefix_len], req.admission.extra_key)
        )
        req.kv.prefix_indices, req.kv.last_node = match.device_indices, match.last_node
        req.prefill.extend_input_len = len(fill_ids) - len(req.kv.prefix_indices)
        req.prefill.full_match_len = match.full_match_len

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
        req.kv.swa_evicted_len = 0

    def make_room(self, num_tokens: int) -> bool:
        """Evict cache until `num_tokens` slots are free; True if they are. With two pools,
        from whichever is short: a full eviction frees both, an SWA one only SWA slots."""
        shortfall = num_tokens - self.full_available_size()
        if shortfall > 0:
            self.tree_cache.evict(shortfall)
        if self.swa_allocator is not None:
            swa_shortfall = num_tokens - self.swa_allocator.swa_available_size()
            if swa_shortfall > 0:
                self.tree_cache.evict_swa(swa_shortfall)
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
        so one prefix has one copy; the request then locks its new, longer prefix. The old
        lock goes first: the insert may then drop the SWA KV of the old prefix's window,
        which no query of the request reads again.
        """
        row = req_row(req)
        kv_len = req.kv.committed_len
        indices = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        key = RadixKey(req.all_token_ids()[:kv_len], req.admission.extra_key)
        owned_from, swa_live_from = len(req.kv.prefix_indices), self._swa_live_from(req)
        self._unlock_for_insert(req)
        inserted = self.tree_cache.insert(
            key, indices, req.admission.priority, chunked, swa_live_from
        )
        self.allocator.free(indices[owned_from : inserted.prefix_len])
        new_indices, new_last_node, _ = self.tree_cache.match_prefix(key)
        self.req_to_token_pool.write(row, owned_from, new_indices[owned_from:])
        self.tree_cache.inc_lock_ref(new_last_node)
        req.kv.prefix_indices, req.kv.last_node = new_indices, new_last_node

    def cache_finished_req(self, req: Req, kv_len: int | None = None) -> None:
        """Hand a finished request's KV to the cache and release its row.

        The request's committed tokens (input + output[:-1]: the last sampled token was
        never forwarded, so it has no KV), or the first `kv_len` of them (never fewer than
        its prefix, which the cache holds), are offered to the cache; slots duplicating what
        it already held are freed at once, as are slots it does not keep and slots
        allocated but never written. A jump-forward's request offers only what it keeps:
        its next match ends where the cached key does, on the window a hybrid model's tree
        keeps live there.
        """
        indices = self._row_slots(req)
        kv_len = req.kv.committed_len if kv_len is None else min(kv_len, req.kv.committed_len)
        kv_len = max(kv_len, len(req.kv.prefix_indices))
        key = RadixKey(req.all_token_ids()[:kv_len], req.admission.extra_key)
        owned_from, swa_live_from = len(req.kv.prefix_indices), self._swa_live_from(req)
        self._unlock_for_insert(req)
        inserted = self.tree_cache.insert(
            key, indices[:kv_len], req.admission.priority, swa_live_from=swa_live_from
        )
        self.allocator.free(indices[owned_from : inserted.prefix_len])
        self.allocator.free(indices[inserted.kept_len :])
        self._release(req)

    def _unlock_for_insert(self, req: Req) -> None:
        """Unlock the request's prefix just before its KV goes into the cache: nothing is
        evicted in between, and the prefix's slots are in the cache either way."""
        self.unlock(req)
        req.kv.last_node = None

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
        req.kv.allocated_len = req.kv.committed_len = req.kv.swa_evicted_len = 0

    # ----- a hybrid model's sliding-window KV -------------------------------------------

    def free_out_of_window(
        self, reqs: Iterable[Req], interval: int = SWA_EVICTION_INTERVAL
    ) -> None:
        """Free the SWA slots of the requests' own tokens that no query will see again, in
        one batched free, for each request only once `interval` are due (1: all that are,
        when a decode step finds the SWA pool short).

        After a step, a request's next query (a decode, the next chunk, a verify's first
        draft) sits at `committed_len` and sees positions from `committed_len + 1 - window`
        on; later queries see less. A batch already in flight under the overlap loop is
        that next query. Retraction recomputes from scratch. The tree's part of the row is
        the tree's to free."""
        if self.swa_allocator is None or self.sliding_window is None:
            return
        table, spans = self.req_to_token_pool.req_to_token, []
        for req in reqs:
            kv = req.kv
            if kv.req_pool_idx is None:  # finished or retracted while the batch ran
                continue
            start = max(kv.swa_evicted_len, len(kv.prefix_indices))
            end = kv.committed_len + 1 - self.sliding_window
            if end - start >= interval:
                spans.append(table[kv.req_pool_idx, start:end])
                kv.swa_evicted_len = end
        if spans:
            self.swa_allocator.free_swa(torch.cat(spans).to(torch.int64))

    def full_available_size(self) -> int:
        """Free full-attention slots (with one pool, every free slot)."""
        if self.swa_allocator is None:
            return self.allocator.available_size()
        return self.swa_allocator.full_available_size()

    def room_with_eviction(self) -> int:
        """Tokens that can get slots now, the cache giving up what it may: with two pools,
        the smaller of the two pools' free and evictable counts."""
        room = self.full_available_size() + self.tree_cache.evictable_size()
        if self.swa_allocator is None:
            return room
        swa_room = self.swa_allocator.swa_available_size() + self.tree_cache.swa_evictable_size()
        return min(room, swa_room)

    def swa_tokens_held_at_most(self, num_tokens: int) -> int:
        """Of `num_tokens` new tokens of one request's decode, how many can hold SWA slots
        at once: the window and an eviction interval at most (all of them with one pool)."""
        if self.sliding_window is None:
            return num_tokens
        return min(num_tokens, self.sliding_window + SWA_EVICTION_INTERVAL)

    def _swa_live_from(self, req: Req) -> int:
        """The first of the request's tokens from which on its own slots all keep their SWA
        KV: before it, the prefix (the tree's) and its own tokens behind the window."""
        return max(req.kv.swa_evicted_len, len(req.kv.prefix_indices))

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
        request's row starts with its prefix, which is locked and is its last node's path.
        With two pools, every SWA slot too, through the mapping: among the SWA free list,
        the cache's tokens that keep SWA KV and the requests' own tokens their window still
        sees; a free full slot and a request's token whose SWA slot was freed map to none."""
        self.tree_cache.check_integrity()
        table = self.req_to_token_pool.req_to_token
        free_rows = set(self.req_to_token_pool.free_slots)
        free, cached = self.allocator.free_slots(), self.tree_cache.cached_slots()
        owned, live, dead = [cached, free], [self.tree_cache.cached_swa_slots()], [free]
        for req in reqs:
            row = req.kv.req_pool_idx
            if row is None or row in free_rows:
                raise AssertionError(f"request {req.rid} has no allocated row")
            prefix_len = len(req.kv.prefix_indices)
            row_slots = table[row, : req.kv.allocated_len].to(torch.int64)
            check_invariant(
                torch.equal(row_slots[:prefix_len].cpu(), req.kv.prefix_indices.cpu()),
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
            evicted = max(req.kv.swa_evicted_len, prefix_len)
            owned.append(row_slots[prefix_len:])
            dead.append(row_slots[prefix_len:evicted])
            live.append(row_slots[evicted:])
        check_each_once(torch.cat(owned), self.allocator.size, "slots")
        if self.swa_allocator is not None:
            mapping = self.swa_allocator.full_to_swa_index_mapping
            check_invariant(
                not mapping[torch.cat(dead)].any(), "a free or out-of-window slot has SWA KV"
            )
            swa = torch.cat([self.swa_allocator.swa_free_slots(), mapping[torch.cat(live)]])
            check_each_once(swa, self.swa_allocator.size_swa, "SWA slots")


def check_each_once(slots: torch.Tensor, size: int, what: str) -> None:
    """`slots` are 1..size, each exactly once."""
    counts = Counter(slots.tolist())
    expected = set(range(1, size + 1))
    check_invariant(
        set(counts) == expected,
        f"{what} unaccounted: {sorted(expected - set(counts))[:10]}"
        f", foreign: {sorted(set(counts) - expected)[:10]}",
    )
    check_invariant(
        max(counts.values(), default=1) == 1,
        f"{what} held twice: {[s for s, c in counts.items() if c > 1][:10]}",
    )


def req_row(req: Req) -> int:
    """The request's row of `req_to_token`, which it must hold."""
    if req.kv.req_pool_idx is None:
        raise RuntimeError(f"request {req.rid} holds no row")
    return req.kv.req_pool_idx
