"""The scheduler: continuous batching over the prefix cache, with overcommit admission,
retraction, and two event loops.

Each round `get_next_batch_to_run` prefers a prefill batch (new requests in, their
prefixes into the tree sooner) and otherwise decodes the running requests. The normal
loop runs a batch and processes its result before building the next one. The overlap
loop launches batch N, then processes N−1's result and builds N+1 while N runs; N+1's
decode inputs are futures in the FutureMap. On CUDA the launch is asynchronous: the
forward runs on its own stream and the sampled tokens come back through pinned memory and
an event (`batch_result`), all from this one thread. On CPU, where every op runs as it is
called, the forward runs on a thread of its own, and N−1 is processed once N's forward has
entered its layers (`forward_thread`). Whoever runs a loop (the worker, the offline
Engine) hands it its message poll, its output sink and when to stop.

The managers, one job each, wired by `engine.build.build_scheduler`: `PrefillManager` (the
waiting queue and what a prefill admits), `DecodeManager` (the running batch and its room),
`OutputProcessor` (what a batch's tokens do to its requests; finishing them), `BatchRunner`
(the forward side), `GrammarQueue`, `LoRASlots`, `RequestLimits`, `CacheManager` (a
request's KV), `InputSync` (tensor-parallel ranks in step: rank 0 records each input it
applies, a follower `apply`s them), and speculative decoding's `DraftManager`
(engine/speculative/), which the scheduler calls where a decode step would be built and
where a verify batch's result is processed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from engine.args import EngineArgs
from engine.sched.batch import ScheduleBatch
from engine.sched.batch_result import BatchResult, PendingResult
from engine.sched.managers import Managers
from engine.sched.req import FinishReason, Req, ReqStatus
from engine.sched.req_state import StopCriteria
from engine.sched.retract import release_req
from engine.sched.status import SchedulerStatus
from engine.sched.tp_sync import (
    Abort,
    AddReq,
    FlushCache,
    GrammarsDone,
    Input,
    LoadLoRA,
    UnloadLoRA,
)

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

ShouldStop = Callable[[], bool]
"""Asked before each turn of an event loop: end the loop now?"""
RecvRequests = Callable[[], None]
"""Run at the start of each turn: take in new requests, aborts and control messages."""
SendOutputs = Callable[[list[Req]], None]
"""Run at the end of each turn with the requests that advanced or finished in it."""

ABORTED_BY_CLIENT = FinishReason("abort", message="aborted by the client")


class Scheduler(SchedulerStatus):
    def __init__(self, args: EngineArgs, model_runner: ModelRunner, managers: Managers) -> None:
        """The managers come wired (`engine.build.build_scheduler`)."""
        self.args, self.model_runner = args, model_runner
        self.device, self.model_config = model_runner.device, model_runner.model_config
        self.context_len = model_runner.context_len
        self.max_total_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = model_runner.req_to_token_pool.size
        m = managers
        self.cache_manager, self.limits, self.stats = m.cache_manager, m.limits, m.stats
        self.output_processor, self.grammar_queue = m.output_processor, m.grammar_queue
        self.grammar_backend, self.lora, self.prefill = m.grammar_backend, m.lora, m.prefill
        self.mask_filler = m.mask_filler
        self.decode, self.batch_runner, self.overlap = m.decode, m.batch_runner, m.overlap
        self.running, self.ratio = self.decode.running, self.decode.ratio
        """The decode manager's, read here as often as its own."""
        self.chunked_prefill_size = self.prefill.chunked_prefill_size
        """Prefill tokens per turn at most (None: unchunked)."""
        self.tp_group, self.input_sync = self.batch_runner.tp_group, m.input_sync
        self.drafts = m.drafts
        self.in_flight: tuple[ScheduleBatch, Future[PendingResult]] | None = None
        self.last_was_chunk = False
        """The last batch cut a prompt short: running decodes get the next turn."""

    # ----- inputs: requests, aborts, cache flushes, adapters ---------------------------

    def add_request(self, req: Req) -> None:
        """Queue `req`, or raise ValueError (LoRAError) if it can never run: nothing
        waits that could not."""
        self.limits.check(req)
        self.lora.check_request(req)
        if self.args.enable_deterministic_inference and req.sampling_params.seed is None:
            req.sampling_params.seed = self.args.random_seed  # same request, same draws
        req.stop = StopCriteria.of(req.sampling_params, frozenset(self.model_config.eos_token_ids))
        req.lifecycle.status = ReqStatus.WAITING
        grammar = req.sampling_params.grammar
        if grammar is not None:
            self.grammar_queue.submit(req, grammar)
        else:
            self.prefill.waiting.append(req)
        self._record(AddReq.of(req))

    def abort_request(self, rid: str, reason: FinishReason = ABORTED_BY_CLIENT) -> None:
        """Finish `rid` now with `reason`; its KV slots are freed at once, in flight or not."""
        self._record(Abort(rid, reason))
        queued = self.grammar_queue.remove(rid) or self.prefill.remove_waiting(rid)
        if queued is not None:
            self.output_processor.finish(queued, reason)
            return
        for live in [*self.running.reqs, *self.prefill.chunked()]:
            if live.rid == rid and not live.finished:
                if live is self.prefill.chunked_req:
                    self.prefill.chunked_req = None
                release_req(live, self.cache_manager)
                self.output_processor.finish(live, reason)
                self.running.remove([live])
                return

    def flush_cache(self) -> None:
        """Empty the prefix cache and both pools (the caller checks that nothing holds KV)."""
        self._record(FlushCache())
        self.cache_manager.reset()

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load an adapter at run time (`LoRASlots.load`)."""
        self.lora.load(name, path)
        self._record(LoadLoRA(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter and free its cached prefixes; 409 while a request uses it."""
        live = [*self.prefill.waiting, *self.prefill.chunked(), *self.grammar_queue]
        self.lora.check_unload(name, [*live, *self.running])
        self.resolve_in_flight()  # a finished batch of it may still be in flight
        self.lora.unload(name, self.cache_manager.tree_cache)
        self._record(UnloadLoRA(name))

    def apply(self, item: Input) -> None:
        """A tensor-parallel follower applies an input rank 0 recorded, as rank 0 did."""
        if isinstance(item, AddReq):
            self.add_request(Req.of(item))
        elif isinstance(item, Abort):
            self.abort_request(item.rid, item.reason)
        elif isinstance(item, FlushCache):
            self.flush_cache()
        elif isinstance(item, LoadLoRA):
            self.load_lora_adapter(item.name, item.path)
        elif isinstance(item, UnloadLoRA):
            self.unload_lora_adapter(item.name)
        else:  # which compiles rank 0 saw end, and how
            self.prefill.waiting += self.grammar_queue.follow(item.ready, dict(item.failed))

    def _record(self, item: Input) -> None:
        if self.input_sync is not None:  # rank 0 records; a follower's record is a no-op
            self.input_sync.record(item)

    def _take_compiled_grammars(self) -> None:
        prefill = self.prefill
        done = self.grammar_queue.take_done(
            idle=not (prefill.waiting or self.running or prefill.chunked_req or self.in_flight)
        )
        prefill.waiting += done.ready
        if done.ready_rids or done.failed:
            self._record(GrammarsDone(done.ready_rids, done.failed))

    # ----- event loops ------------------------------------------------------------------

    def begin_turn(self) -> bool:
        """Start an event-loop turn, after its messages are in: take the compiled grammars
        in, then at TP > 1 bring every rank to the same inputs (`InputSync`); a rank other
        than 0 applies rank 0's instead of deciding for itself. False: rank 0 has stopped,
        and this follower's loop ends."""
        sync = self.input_sync
        leads = sync is None or self.tp_group.is_first_rank
        if leads and self.grammar_queue:
            self._take_compiled_grammars()
        if sync is None:
            return True
        if leads:
            sync.lead_turn(self.snapshot(adapters=False).in_step())
            return True
        turn = sync.follow_turn()
        if turn is None:
            return False
        for item in turn.inputs:
            self.apply(item)
        sync.check_in_step(turn.state, self.snapshot(adapters=False).in_step())
        return True

    def follow(self) -> None:
        """A rank other than 0: run rank 0's turns until it stops."""
        self.run_event_loop(should_stop=lambda: False)

    def event_loop_normal(
        self, should_stop: ShouldStop, recv_requests: RecvRequests, send_outputs: SendOutputs
    ) -> None:
        """Each turn until `should_stop()`: receive; while there is work, build the next
        batch, run it and process its result; send the requests that advanced or finished."""
        while not should_stop():
            recv_requests()
            if not self.begin_turn():
                return
            if self.has_work():
                batch = self.get_next_batch_to_run()
                if batch is None:
                    self.ratio.on_idle()
                else:
                    self.process_batch_result(batch, self.run_batch(batch))
            send_outputs(self.output_processor.take_outputs())

    def event_loop_overlap(
        self, should_stop: ShouldStop, recv_requests: RecvRequests, send_outputs: SendOutputs
    ) -> None:
        """As `event_loop_normal`, but each turn launches its batch and processes the
        previous turn's batch while it runs; the last batch may still be in flight when the
        loop stops."""
        while not should_stop():
            recv_requests()
            if not self.begin_turn():
                return
            if self.has_work():
                batch = self.get_next_batch_to_run()
                launched = None
                if batch is not None:
                    launched = (batch, self.batch_runner.launch(self.run_batch, batch))
                self.resolve_in_flight()
                self.in_flight = launched
                if launched is None:
                    self.ratio.on_idle()
            send_outputs(self.output_processor.take_outputs())

    def run_event_loop(
        self,
        should_stop: ShouldStop,
        recv_requests: RecvRequests = lambda: None,
        send_outputs: SendOutputs = lambda reqs: None,
    ) -> None:
        """The configured loop, overlap or normal. Offline callers have no messages to
        receive and read their requests directly, so both hooks default to nothing."""
        loop = self.event_loop_overlap if self.overlap else self.event_loop_normal
        loop(should_stop, recv_requests, send_outputs)

    def run_batch(self, batch: ScheduleBatch) -> PendingResult:
        """The batch's forward and sampling (`BatchRunner.run`), waiting for nothing."""
        observer = self.stats.observer
        return self.batch_runner.run(batch, observer.on_progress if observer else None)

    def resolve_in_flight(self) -> None:
        """Wait for the batch on the forward side and process its result."""
        if self.in_flight is not None:
            batch, future = self.in_flight
            self.in_flight = None
            self.process_batch_result(batch, future.result())

    def process_batch_result(self, batch: ScheduleBatch, pending: PendingResult) -> None:
        """Read the batch's result (timing it for the observer), let the output processor
        apply it, and move the requests it says leave the running batch."""
        result: BatchResult = pending.result()
        if self.stats.observer is not None:
            self.stats.observer.on_forward(
                batch.forward_mode.name.lower(), len(batch.reqs), pending.forward_seconds()
            )
        if result.verify is not None:
            assert self.drafts is not None, "a verify batch"
            processed = self.drafts.process_result(batch, result.verify, self.running)
        else:
            processed = self.output_processor.process_batch_result(batch, result)
            self.running.remove(processed.leaving)
        for req in processed.requeued:
            self.prefill.waiting.insert(0, req)
        if any(req.finished for req in self.prefill.chunked()):  # failed mid-prompt
            self.prefill.chunked_req = None
        self.cache_manager.free_out_of_window(batch.reqs)

    def has_work(self) -> bool:
        queued = self.prefill.waiting or self.prefill.chunked_req or self.grammar_queue
        return bool(queued or self.running or self.in_flight)

    def shutdown(self) -> None:
        """Finish the batch a stopped overlap loop left in flight (its forward counts in the
        stats and the observer like any other), then stop the threads."""
        self.resolve_in_flight()
        if self.input_sync is not None:
            self.input_sync.stop()
        self.batch_runner.shutdown()
        self.mask_filler.shutdown()
        if self.grammar_backend is not None:
            self.grammar_backend.shutdown()

    # ----- building batches -------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill batch if one can be built, else the running decodes; but while a long
        prompt is prefilled chunk by chunk, its turns alternate with decode turns, so that
        running requests keep going meanwhile (unless they ride in its batches: mixed)."""
        interleave = self.last_was_chunk and bool(self.running) and not self.args.enable_mixed_chunk
        batch = None if interleave else self.get_new_batch_prefill()
        self.last_was_chunk = batch is not None and bool(batch.chunked)
        if batch is None and self.running:
            batch = self.update_running_batch()
        return batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        in_flight = self.in_flight[0].reqs if self.in_flight is not None else []
        admitted = self.prefill.admit(self.running, in_flight, self.ratio.new_token_ratio)
        if admitted is None:
            return None
        batch = self._prepare(admitted.reqs, admitted.with_decodes)
        self.running.add([r for r in admitted.reqs if not r.prefill.is_chunked])
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        """A decode step for every running request, once there is room for it (the
        requests a retraction sends back queue first); with speculative decoding, a verify
        step of their drafts where any request drafts (`DraftManager.next_batch`)."""
        if self.drafts is not None:
            self.resolve_in_flight()  # drafts continue the tokens the last batch sampled
        retracted = self.decode.make_room(self.resolve_in_flight)
        if retracted is not None:
            self.prefill.waiting[:0] = retracted.retracted
            if retracted.aborted is not None:
                self.output_processor.outputs.append(retracted.aborted)
        if not self.running:
            return None
        verify = self.drafts.next_batch(self.running) if self.drafts is not None else None
        return verify if verify is not None else self._prepare([], with_decodes=True)

    def _prepare(self, extend_reqs: list[Req], with_decodes: bool) -> ScheduleBatch | None:
        """The batch of `extend_reqs` and, `with_decodes`, a decode step of the running batch."""
        if self.in_flight is not None and (
            any(r.needs_output_history for r in extend_reqs)
            or (
                with_decodes
                and self.running.num_req_state
                and any(r.needs_output_history for r in self.running)
            )
        ):
            # Penalties, min_new_tokens, seeded sampling and grammars read the output so far
            # on the CPU side; wait for the in-flight batch rather than use a stale history
            # (which finishes, or jumps forward, some running requests).
            self.resolve_in_flight()
        if not extend_reqs and not (with_decodes and self.running):
            return None
        if self.in_flight is not None:
            batch_reqs = itertools.chain(extend_reqs, self.running if with_decodes else ())
            if self.lora.needs_swap(batch_reqs):  # the in-flight batch may read the slot
                self.resolve_in_flight()
        batch = ScheduleBatch.prepare(
            extend_reqs,
            self.running if with_decodes else None,
            self.cache_manager,
            self.model_runner.token_to_kv_pool,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            self.mask_filler,
        )
        self.lora.assign(batch)
        self.stats.count_batch(batch.forward_mode.name.lower())
        return batch


def after_turns(num_turns: int) -> ShouldStop:
    """A `should_stop` that ends an event loop after `num_turns` turns, for callers that do
    work of their own between turns (the offline stream yields after each)."""
    turns = itertools.count()
    return lambda: next(turns) >= num_turns
