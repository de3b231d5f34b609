"""Admission with overcommit: which waiting requests join the next prefill batch.

Budget (`rem_total_tokens`) = free slots + evictable tree slots − what running requests
are expected to still need. A running request reserves `min(max_new_tokens −
len(output_ids), CLIP) × new_token_ratio`: overcommitted, because most requests stop
early. A request being admitted must fit `extend_input_len + min(max_new_tokens −
len(output_ids), CLIP)` in full (a retracted request's output so far is in its extend) —
the discount applies to requests already running, never to the newcomer.

A hybrid model's SWA pool has a budget of its own (`rem_swa_tokens`), which neither may
overdraw: a request holds SWA slots for its prompt and, as it decodes, for its window and an
eviction interval at most (`CacheManager.swa_tokens_held_at_most`), the rest being freed. A
prefill longer than the SWA pool (a retracted request's prompt and output) goes in pieces the
SWA budget holds, as does a chunked prefill's next chunk when the budget is short.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from engine.sched.cache_manager import CacheManager
from engine.sched.req import Req


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()
    """Admitted (or chunked); try the next request."""
    NO_TOKEN = enum.auto()
    """Out of KV budget: stop admitting this round."""
    OTHER = enum.auto()
    """Out of prefill-token or chunk budget: stop admitting this round."""


class PrefillAdder:
    def __init__(
        self,
        cache_manager: CacheManager,
        running_reqs: Iterable[Req],
        new_token_ratio: float,
        clip_max_new_tokens: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        self.cache_manager = cache_manager
        self.clip_max_new_tokens = clip_max_new_tokens
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = (
            None
            if chunked_prefill_size is None
            else chunked_prefill_size - mixed_with_decode_tokens
        )
        reserved = [tokens_to_come(r, clip_max_new_tokens) * new_token_ratio for r in running_reqs]
        self.rem_total_token_offset = mixed_with_decode_tokens + sum(reserved)
        self.rem_swa_token_offset = mixed_with_decode_tokens + sum(
            cache_manager.swa_tokens_held_at_most(int(n)) for n in reserved
        )
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    @property
    def rem_total_tokens(self) -> float:
        """Recomputed on every read: locking a prefix shrinks `evictable_size`."""
        cache = self.cache_manager
        return (
            cache.full_available_size()
            + cache.tree_cache.evictable_size()
            - self.rem_total_token_offset
        )

    @property
    def rem_swa_tokens(self) -> float:
        """As `rem_total_tokens`, for a hybrid model's SWA pool (the tree gives up SWA KV
        apart from full KV); with one pool, `rem_total_tokens`."""
        cache = self.cache_manager
        if cache.swa_allocator is None:
            return self.rem_total_tokens
        return (
            cache.swa_allocator.swa_available_size()
            + cache.tree_cache.swa_evictable_size()
            - self.rem_swa_token_offset
        )

    def _fits(self, req: Req, max_new_tokens: int) -> bool:
        """Whether `req`'s prompt and `max_new_tokens` fit both budgets; a prefill that no
        SWA budget could hold whole fits where a piece of it does (`_swa_piece`)."""
        extend_len = req.prefill.extend_input_len
        if extend_len + max_new_tokens > self.rem_total_tokens:
            return False
        piece = self._swa_piece(req, max_new_tokens)
        swa = self.cache_manager.swa_allocator
        if piece is None or swa is None:
            return True
        swa_tokens = extend_len + self.cache_manager.swa_tokens_held_at_most(max_new_tokens)
        return piece > 0 and swa_tokens > swa.size_swa

    def _swa_piece(self, req: Req, max_new_tokens: int) -> int | None:
        """With a sliding window, the tokens of `req`'s prefill the SWA budget holds now,
        when it cannot hold all of them and `max_new_tokens`' SWA share (None: it can).
        A piece's SWA KV behind its window is the tree's to evict before the next piece,
        so a prefill longer than the SWA pool itself (a retracted request's prompt and
        output) goes in pieces."""
        cache = self.cache_manager
        if cache.swa_allocator is None:
            return None
        swa_tokens = req.prefill.extend_input_len + cache.swa_tokens_held_at_most(max_new_tokens)
        if swa_tokens <= self.rem_swa_tokens:
            return None
        return max(0, int(self.rem_swa_tokens))

    def budget_exhausted(self) -> bool:
        return (
            self.rem_total_tokens <= 0
            or self.rem_swa_tokens <= 0
            or self.rem_input_tokens <= 0
            or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0)
        )

    def add_chunked_req(self, req: Req) -> None:
        """Continue a chunked prefill first, before any newcomer: it was admitted already.
        A round whose SWA budget holds none of it passes it over; it stays the chunked
        request."""
        req.prefill.extend_input_len = len(req.all_token_ids()) - req.kv.allocated_len
        if self._swa_piece(req, max_new_tokens=0) == 0:
            self.new_chunked_req = req
            return
        self._add_prefill(req, max_new_tokens=0)

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admit `req` (matched by `CacheManager.match_req`) if it fits; lock its prefix."""
        max_new_tokens = tokens_to_come(req, self.clip_max_new_tokens)
        if not self._fits(req, max_new_tokens):
            return AddReqResult.NO_TOKEN
        if req.prefill.extend_input_len > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        self.cache_manager.lock(req)
        if not self._fits(req, max_new_tokens):  # the lock took the prefix out of `evictable`
            self.cache_manager.unlock(req)
            return AddReqResult.NO_TOKEN
        self._add_prefill(req, max_new_tokens)
        return AddReqResult.CONTINUE

    def _add_prefill(self, req: Req, max_new_tokens: int) -> None:
        """Admit `req`, truncated to the chunk budget, or the piece the SWA budget holds, if
        it does not fit in one piece."""
        limits = [self.rem_chunk_tokens, self._swa_piece(req, max_new_tokens)]
        limit = min((n for n in limits if n is not None), default=None)
        if limit is not None and req.prefill.extend_input_len > limit:
            req.prefill.extend_input_len = limit
            req.prefill.is_chunked = True
            self.new_chunked_req = req
            max_new_tokens = 0
        else:
            req.prefill.is_chunked = False
        self.can_run_list.append(req)
        self.rem_total_token_offset += req.prefill.extend_input_len + max_new_tokens
        self.rem_swa_token_offset += (
            req.prefill.extend_input_len
            + self.cache_manager.swa_tokens_held_at_most(max_new_tokens)
        )
        self.rem_input_tokens -= req.prefill.extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.prefill.extend_input_len


def tokens_to_come(req: Req, clip_max_new_tokens: int) -> int:
    """The output tokens `req` may still generate, clipped: a retracted request prefills the
    ones it generated again, so they count in its prompt, not here."""
    return min(req.sampling_params.max_new_tokens - len(req.output_ids), clip_max_new_tokens)
