"""The running requests' side of scheduling (mini-sglang's `DecodeManager`): the batch
that decodes a token per request each step, room for those tokens (evict, then retract),
and the new-token ratio that overcommit admission reserves with."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.sched.cache_manager import CacheManager
from engine.sched.new_token_ratio import NewTokenRatioTracker
from engine.sched.retract import RetractResult, retract_decode
from engine.sched.running_batch import RunningBatch
from engine.sched.stats import SchedulerStats

logger = logging.getLogger(__name__)


class DecodeManager:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        cache_manager: CacheManager,
        stats: SchedulerStats,
        schedule_conservativeness: float,
    ):
        self.running = RunningBatch(vocab_size, device)
        self.ratio = NewTokenRatioTracker(schedule_conservativeness)
        self.cache_manager = cache_manager
        self.stats = stats

    def make_room(self, resolve_in_flight: Callable[[], None]) -> RetractResult | None:
        """Free slots for one more token per running request (`has_room`); if there are
        not enough, the in-flight batch is processed (nothing retracted may be in flight)
        and, if that is still not enough, requests are retracted. The retraction, if one
        happened: the caller queues its requests again."""
        if self.has_room():
            self.ratio.on_decode_step()
            return None
        resolve_in_flight()
        if not self.running or self.has_room():
            return None
        result = retract_decode(self.running.reqs, self.cache_manager)
        kept = {id(r) for r in result.kept}
        self.running.keep([i for i, r in enumerate(self.running.reqs) if id(r) in kept])
        self.stats.count_retracted(result.retracted)
        if result.kept:
            self.ratio.on_retract(result.kept)
        logger.info(
            "retracted %d request(s); new_token_ratio %.3f",
            len(result.retracted),
            self.ratio.new_token_ratio,
        )
        return result

    def has_room(self) -> bool:
        """Whether one more token per running request fits in both pools. Short of free
        slots, the requests first free every SWA slot their windows left behind (dead KV
        the batched frees had not reached yet, unlike the cache's live KV), then the cache
        evicts what is still short."""
        cache, num_tokens = self.cache_manager, len(self.running)
        if cache.allocator.available_size() < num_tokens:
            cache.free_out_of_window(self.running.reqs, interval=1)
        return cache.make_room(num_tokens)
