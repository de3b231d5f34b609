"""Queue order: which waiting requests are offered to admission first."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable

import torch

from engine import constants
from engine.cache.radix_cache import token_only_tree
from engine.cache.radix_key import RadixKey
from engine.sched.cache_manager import CacheManager
from engine.sched.req import Req

SCHEDULE_POLICIES = constants.SCHEDULE_POLICIES
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")


class SchedulePolicy:
    """Sorts the waiting queue in place, once per scheduling round.

    - fcfs: arrival order (retracted requests sit at the head).
    - lpm: longest radix hit first — cheap requests first, and their prefixes stay hot.
      Above `LPM_MAX_QUEUE_LEN` waiting requests it falls back to fcfs.
    - dfs-weight: depth-first over the tree, heavier subtrees first, so requests sharing a
      subtree run together (the SGLang paper's theorem).
    - lof: longest max_new_tokens first. random. priority: higher value first, then arrival.
    - routing-key: requests whose routing key is most common in the running batch first.

    The cache-aware ones (lpm, dfs-weight) fall back to fcfs when the cache shares no prefix
    (`disable`): there is nothing to match.
    """

    def __init__(self, policy: str, cache_manager: CacheManager, seed: int = 0) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"unknown schedule policy {policy!r}; choose one of {', '.join(SCHEDULE_POLICIES)}"
            )
        self.policy = policy
        self.cache_manager = cache_manager
        self.tree_cache = cache_manager.tree_cache
        self.rng = random.Random(seed)
        self.waiting_queue_radix_tree = token_only_tree()
        """The waiting queue's keys, for in-batch prefix dedup."""

    def active_policy(self, waiting_queue: list[Req]) -> str:
        if self.policy == "lpm" and len(waiting_queue) > constants.LPM_MAX_QUEUE_LEN:
            return "fcfs"
        if self.policy in CACHE_AWARE_POLICIES and self.tree_cache.disable:
            return "fcfs"
        return self.policy

    def calc_priority(
        self,
        waiting_queue: list[Req],
        running_reqs: Iterable[Req] = (),
        in_flight_prefill: Iterable[Req] = (),
    ) -> set[str]:
        """Sort `waiting_queue`; return the rids deferred by in-batch prefix dedup."""
        policy = self.active_policy(waiting_queue)
        deferred: set[str] = set()
        if policy in CACHE_AWARE_POLICIES:
            deferred = self._compute_prefix_matches(waiting_queue, in_flight_prefill)
        if policy == "lpm":
            waiting_queue.sort(
                key=lambda r: float("inf") if r.rid in deferred else -len(r.kv.prefix_indices)
            )
        elif policy == "dfs-weight":  # each request matched by `_compute_prefix_matches`
            waiting_queue[:] = self.tree_cache.dfs_weight_order(
                waiting_queue, lambda r: r.kv.last_node
            )
        elif policy == "lof":
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        elif policy == "priority":
            waiting_queue.sort(key=lambda r: -r.admission.priority)
        elif policy == "routing-key":
            counts: Counter[str | None] = Counter(r.admission.routing_key for r in running_reqs)
            counts[None] = 0  # requests without a key form no group
            waiting_queue.sort(key=lambda r: -counts[r.admission.routing_key])
        return deferred

    def _compute_prefix_matches(
        self, waiting_queue: list[Req], in_flight_prefill: Iterable[Req]
    ) -> set[str]:
        """Match every waiting request against the tree; defer those that hit little in the
        tree but share a long prefix with an earlier queue-mate or an in-flight prefill, so
        that one representative prefills it and the rest hit next round. A request that hits
        more is deferred only while an in-flight prefill (a chunked prompt among them) is
        computing a long stretch of its prefix beyond that hit."""
        sim = self.waiting_queue_radix_tree
        sim.reset()
        for req in in_flight_prefill:
            self._sim_insert(RadixKey(req.all_token_ids(), req.admission.extra_key))
        deferred = set()
        for req in waiting_queue:
            self.cache_manager.match_req(req)
            hit = len(req.kv.prefix_indices)
            key = RadixKey(req.all_token_ids(), req.admission.extra_key)
            # What it could reuse next round: a request computing prompt logprobs may not.
            shared = min(len(sim.match_prefix(key).device_indices), req.max_prefix_len)
            if hit > constants.IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                if shared - hit >= constants.IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                    deferred.add(req.rid)
                continue
            if shared >= constants.IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                deferred.add(req.rid)
            else:
                self._sim_insert(key)
        return deferred

    def _sim_insert(self, key: RadixKey) -> None:
        self.waiting_queue_radix_tree.insert(key, torch.zeros(len(key), dtype=torch.int64))
