"""The prefill side of the scheduler (mini-sglang's PrefillManager): the waiting queue, the
prompt being prefilled chunk by chunk, and which of them the next prefill batch admits,
in the policy's order and within the KV budget (`PrefillAdder`)."""

from __future__ import annotations

from typing import NamedTuple

from engine.args import EngineArgs
from engine.sched.cache_manager import CacheManager
from engine.sched.lora_slots import LoRASlots
from engine.sched.policy import SchedulePolicy
from engine.sched.prefill_adder import AddReqResult, PrefillAdder
from engine.sched.req import Req, ReqStatus, take_by_rid
from engine.sched.running_batch import RunningBatch
from engine.sched.stats import SchedulerStats


class Admitted(NamedTuple):
    """The requests of the next prefill batch (its chunked one included), and whether
    the running decodes ride along in it (a mixed batch)."""

    reqs: list[Req]
    with_decodes: bool


class PrefillManager:
    def __init__(
        self,
        args: EngineArgs,
        cache_manager: CacheManager,
        lora: LoRASlots,
        stats: SchedulerStats,
        chunked_prefill_size: int | None,
        max_running_requests: int,
    ):
        self.args = args
        self.cache_manager = cache_manager
        self.policy = SchedulePolicy(args.schedule_policy, cache_manager, seed=args.random_seed)
        self.lora = lora
        self.stats = stats
        self.chunked_prefill_size = chunked_prefill_size
        """Prefill tokens per turn at most (None: unchunked)."""
        self.max_running_requests = max_running_requests
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None
        """The request whose prompt is being prefilled chunk by chunk; it holds KV."""

    def chunked(self) -> list[Req]:
        """The request being chunked, if any, as a list."""
        return [self.chunked_req] if self.chunked_req is not None else []

    def remove_waiting(self, rid: str) -> Req | None:
        """Take request `rid` out of the waiting queue (an abort), if it waits there."""
        return take_by_rid(self.waiting, rid)

    def admit(
        self, running: RunningBatch, in_flight: list[Req], new_token_ratio: float
    ) -> Admitted | None:
        """Take the next prefill batch's requests off the waiting queue (None: none fit).
        `in_flight`: the requests of the batch the forward side runs now."""
        if not self.waiting and self.chunked_req is None:
            return None
        if len(running) >= self.max_running_requests:
            return None
        if self.chunked_req is not None:  # its later chunks are computing its prompt too
            in_flight = [*in_flight, self.chunked_req]
        chunk = self.chunked_prefill_size
        deferred = self.policy.calc_priority(self.waiting, running, in_flight)
        mixed = (
            self.args.enable_mixed_chunk
            and bool(running)
            # half the turn's tokens at least stay the prefill's
            and 2 * len(running) <= (chunk or self.args.max_prefill_tokens)
            and self.cache_manager.allocator.available_size() >= len(running)
        )
        adder = PrefillAdder(
            self.cache_manager,
            running,
            new_token_ratio,
            self.args.clip_max_new_tokens,
            self.args.max_prefill_tokens,
            chunk,
            mixed_with_decode_tokens=len(running) if mixed else 0,
        )
        chunked = self.chunked()
        for req in chunked:
            adder.add_chunked_req(req)
        adapters = self.lora.held([*running, *chunked])
        for req in self.waiting:
            if req.rid in deferred or not self.lora.fits(req, adapters):
                continue  # its adapter waits for a slot: it never fails for that
            if (
                len(running) + len(adder.can_run_list) >= self.max_running_requests
                or adder.budget_exhausted()
            ):
                break
            self.cache_manager.match_req(req)
            result = adder.add_one_req(req)
            if req.admission.lora_name is not None and adder.can_run_list[-1:] == [req]:
                adapters.add(req.admission.lora_name)
            if result is not AddReqResult.CONTINUE:
                break
        if not adder.can_run_list:
            return None
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in adder.can_run_list:
            if req.prefill.cached_tokens is None:  # first admission: count the radix hit once
                req.prefill.cached_tokens = len(req.kv.prefix_indices)
                self.stats.cache_hit_tokens += len(req.kv.prefix_indices)
                self.stats.cache_full_hit_tokens += req.prefill.full_match_len
                self.stats.cache_query_tokens += len(req.origin_input_ids)
                if self.stats.observer is not None:
                    self.stats.observer.on_admit(req)
            req.lifecycle.status = ReqStatus.RUNNING
            self.stats.prefill_tokens += req.prefill.extend_input_len
        self.chunked_req = adder.new_chunked_req
        return Admitted(adder.can_run_list, mixed)
