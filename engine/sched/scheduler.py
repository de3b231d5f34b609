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
entered its layers (`forward_thread`). Whoever runs a loop (the worker, the
offline Engine) hands it its message poll, its output sink and when to stop.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.args import EngineArgs
from engine.cache.base_prefix_cache import BasePrefixCache
from engine.cache.chunk_cache import ChunkCache
from engine.cache.namespace import PrefixNamespace
from engine.cache.radix_cache import RadixCache
from engine.distributed import get_tp_group
from engine.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    PendingGrammar,
    ReasoningGrammarMatcher,
)
from engine.grammar.jump_forward import JumpForward, decodes_concatenatively, plan_jump_forward
from engine.lora import LoRAError, LoRAManager
from engine.sampling.sampler import Sampler, SamplerOutput
from engine.sched.batch import ScheduleBatch
from engine.sched.batch_result import BatchResult, PendingResult
from engine.sched.cache_manager import CacheManager
from engine.sched.chunk_size import resolve_chunked_prefill_size
from engine.sched.forward_thread import ForwardThread
from engine.sched.future_map import FutureMap
from engine.sched.new_token_ratio import NewTokenRatioTracker
from engine.sched.policy import SchedulePolicy
from engine.sched.prefill_adder import AddReqResult, PrefillAdder
from engine.sched.req import FinishReason, Req, ReqStatus
from engine.sched.retract import release_req, retract_decode
from engine.sched.running_batch import RunningBatch
from engine.sched.tp_sync import (
    Abort,
    AddReq,
    FlushCache,
    GrammarsDone,
    InputSync,
    LoadLoRA,
    UnloadLoRA,
)

if TYPE_CHECKING:
    from engine.model.runner import ModelRunner

logger = logging.getLogger(__name__)

StopStringChecker = Callable[[Req], str | None]
"""Returns the stop string the request's decoded tail now contains, if any."""
ShouldStop = Callable[[], bool]
"""Asked before each turn of an event loop: end the loop now?"""
RecvRequests = Callable[[], None]
"""Run at the start of each turn: take in new requests, aborts and control messages."""
SendOutputs = Callable[[list[Req]], None]
"""Run at the end of each turn with the requests that advanced or finished in it."""

GRAMMAR_POLL_INTERVAL_S = 0.005
"""With only compiling requests to serve, a round waits this long for a compile to end
rather than spin; short, so that the event loop still receives new requests promptly."""

AnyGrammarMatcher = GrammarMatcher | ReasoningGrammarMatcher
"""A request's grammar state: plain, or waiting for the end of a reasoning section."""

ABORTED_BY_CLIENT = FinishReason("abort", message="aborted by the client")


class SchedulerObserver(Protocol):
    """Hears the per-request and per-batch events that counters cannot carry (the worker
    turns them into histograms and trace spans)."""

    def on_admit(self, req: Req) -> None:
        """`req` joins a batch for the first time (not after a retraction or a chunk)."""

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        """A forward pass and its sampling took `seconds`; heard when its result is read."""

    def on_progress(self) -> None:
        """A prefill's forward finished one more layer: the loop computes, it is not stuck
        (heard on the forward's thread; decode steps, short, report nothing)."""


@dataclass
class SchedulerStats:
    """Counters the observability layer exports, and the observer of events, if any."""

    num_retractions: int = 0
    retracted_input_tokens: int = 0
    retracted_output_tokens: int = 0
    prefill_tokens: int = 0
    """Tokens actually computed by prefill (radix hits excluded)."""
    cache_hit_tokens: int = 0
    cache_query_tokens: int = 0
    generation_tokens: int = 0
    forward_modes: dict[str, int] = field(default_factory=dict)
    jump_forwards: int = 0
    jump_forward_tokens: int = 0
    """Output tokens taken from grammar-forced text: each is a decode pass saved."""
    observer: SchedulerObserver | None = field(default=None, repr=False, compare=False)

    def counters(self) -> dict[str, Any]:
        """The plain numbers (a copy), e.g. for a status endpoint."""
        return {
            f.name: dict(v) if isinstance(v := getattr(self, f.name), dict) else v
            for f in fields(self)
            if f.name != "observer"
        }


class Scheduler:
    def __init__(
        self,
        args: EngineArgs,
        model_runner: ModelRunner,
        stop_string_checker: StopStringChecker | None = None,
        grammar_backend: GrammarBackend | None = None,
    ):
        self.args = args
        self.model_runner = model_runner
        self.device = model_runner.device
        self.model_config = model_runner.model_config
        self.context_len = model_runner.context_len
        self.max_total_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = model_runner.req_to_token_pool.size
        self.stop_string_checker = stop_string_checker
        self.grammar_backend = grammar_backend
        allocator = model_runner.token_to_kv_pool_allocator
        tree_cache: BasePrefixCache = (
            ChunkCache(allocator.device)
            if args.disable_radix_cache
            else RadixCache(allocator, args.radix_eviction_policy)
        )
        self.cache_manager = CacheManager(model_runner.req_to_token_pool, allocator, tree_cache)
        self.policy = SchedulePolicy(
            args.schedule_policy, self.cache_manager, seed=args.random_seed
        )
        self.ratio = NewTokenRatioTracker(args.schedule_conservativeness)
        self.sampler = Sampler()
        self.future_map = FutureMap(
            self.max_running_requests, self.device, debug=args.debug_future_map
        )
        graph_runner = model_runner.graph_runner
        if graph_runner is not None and not args.debug_future_map:
            # Bake this scheduler's future lookup into the decode graphs now, not at the
            # first decode batch.
            graph_runner.capture(self.future_map.resolve)
        self.waiting_queue: list[Req] = []
        self.grammar_queue: list[Req] = []
        """Requests whose grammar is compiling; they join the waiting queue when it is done."""
        self.running = RunningBatch(self.model_config.vocab_size, self.device)
        self.chunked_req: Req | None = None
        self.outputs: list[Req] = []
        self.stats = SchedulerStats()
        if args.enable_jump_forward and args.disable_radix_cache:
            raise ValueError(
                "enable_jump_forward needs the radix cache: "
                "a jump hands the request's KV to the tree"
            )
        self.jump_forward = False
        if args.enable_jump_forward and grammar_backend is not None:
            self.jump_forward = decodes_concatenatively(grammar_backend.tokenizer)
            if not self.jump_forward:
                logger.warning(
                    "jump-forward is off: this tokenizer's pieces do not decode independently"
                )
        self.chunked_prefill_size = resolve_chunked_prefill_size(
            args.chunked_prefill_size, self.device
        )
        """Prefill tokens per turn at most (None: unchunked); 0 asks for the device's."""
        self.last_was_chunk = False
        """The last batch cut a prompt short: running decodes get the next turn."""
        if args.disable_overlap_schedule is None:
            self.overlap = self.device.type == "cuda"
        else:
            self.overlap = not args.disable_overlap_schedule
        # Under overlap on CUDA the forward is queued on its own stream from this thread;
        # on CPU, where ops run as they are called, only a thread of its own overlaps it.
        self.forward_stream = (
            torch.cuda.Stream(self.device) if self.overlap and self.device.type == "cuda" else None
        )
        self.forward_thread = (
            ForwardThread() if self.overlap and self.forward_stream is None else None
        )
        self.in_flight: tuple[ScheduleBatch, Future[PendingResult]] | None = None
        self.tp_group = get_tp_group()
        self.input_sync = InputSync(self.tp_group) if self.tp_group.size > 1 else None
        """At TP > 1: rank 0 broadcasts each turn's inputs, the other ranks apply them."""
        self.lora: LoRAManager | None = model_runner.lora_manager
        self.lora_roots = [os.path.realpath(root) for root in args.lora_roots()]
        for name, path in args.lora_entries().items():
            self._lora_manager().load(name, path)

    # ----- requests in ------------------------------------------------------------------

    def add_request(self, req: Req) -> None:
        """Queue `req`, or raise ValueError if it can never run (never leave it waiting)."""
        input_len = len(req.origin_input_ids)
        if input_len == 0:
            raise ValueError("the prompt is empty")
        req.sampling_params.verify(self.model_config.vocab_size)
        if (
            max(req.origin_input_ids) >= self.model_config.vocab_size
            or min(req.origin_input_ids) < 0
        ):
            raise ValueError(f"prompt token ids must lie in [0, {self.model_config.vocab_size})")
        if input_len >= self.context_len:
            raise ValueError(
                f"the prompt has {input_len} tokens; the context length is {self.context_len}"
            )
        if req.sampling_params.logprob_start_len >= input_len:
            raise ValueError(
                f"logprob_start_len must be below the prompt length ({input_len}), "
                f"got {req.sampling_params.logprob_start_len}"
            )
        if req.sampling_params.stop and self.stop_string_checker is None:
            raise ValueError(
                "stop strings need a tokenizer; this engine runs with skip_tokenizer_init"
            )
        params = req.sampling_params
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - input_len)
        needed = input_len + min(params.max_new_tokens, self.args.clip_max_new_tokens)
        if needed > self.max_total_tokens:
            raise ValueError(
                f"the prompt ({input_len} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"needs {needed} KV slots; the KV cache holds {self.max_total_tokens}. "
                "Lower max_tokens or raise --max-total-tokens"
            )
        grammar = params.grammar
        if grammar is not None and self.grammar_backend is None:
            raise ValueError(
                "json_schema, regex and ebnf need a tokenizer and a grammar backend; this "
                "engine runs with skip_tokenizer_init or --grammar-backend none"
            )
        if req.lora_name is not None and (
            self.lora is None or req.lora_name not in self.lora.adapters
        ):
            raise LoRAError(f"no LoRA adapter named {req.lora_name!r} is loaded", 404, "model")
        req.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        req.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else req.eos_token_ids
        )
        req.plain_decode = not (params.logprobs or params.stop or grammar is not None)
        req.status = ReqStatus.WAITING
        if grammar is not None:
            req.pending_grammar = self._grammar_backend().submit(*grammar)
            self.grammar_queue.append(req)
        else:
            self.waiting_queue.append(req)
        if self.input_sync is not None:
            self.input_sync.record(
                AddReq(
                    req.rid,
                    req.origin_input_ids,
                    params,
                    req.extra_key,
                    req.priority,
                    req.routing_key,
                )
            )

    def abort_request(self, rid: str, reason: FinishReason = ABORTED_BY_CLIENT) -> None:
        """Finish `rid` now with `reason`; its KV slots are freed at once, in flight or not."""
        if self.input_sync is not None:
            self.input_sync.record(Abort(rid, reason))
        for queue in (self.waiting_queue, self.grammar_queue):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self._finish(req, reason)
                    return
        holding_kv = self.running.reqs
        if self.chunked_req is not None:
            holding_kv = [*holding_kv, self.chunked_req]
        for live in holding_kv:
            if live.rid == rid and not live.finished:
                if live is self.chunked_req:
                    self.chunked_req = None
                release_req(live, self.cache_manager)
                self._finish(live, reason)
                self.running.remove([live])
                return

    def flush_cache(self) -> None:
        """Empty the prefix cache and both pools (the caller checks that nothing holds KV)."""
        if self.input_sync is not None:
            self.input_sync.record(FlushCache())
        self.cache_manager.reset()

    # ----- event loops ------------------------------------------------------------------

    def begin_turn(self) -> bool:
        """Start an event-loop turn, after its messages are in: take the compiled grammars
        in, then at TP > 1 bring every rank to the same inputs (`InputSync`); a rank other
        than 0 applies rank 0's instead of deciding for itself. False: rank 0 has stopped,
        and this follower's loop ends."""
        leads = self.input_sync is None or self.tp_group.is_first_rank
        if leads and self.grammar_queue:
            self.move_ready_grammar_requests()
        return self.input_sync is None or self.input_sync.begin_turn(self)

    def fingerprint(self) -> dict[str, int]:
        """Numbers two ranks in step agree on between turns (cheap: no walk, no sync)."""
        cache, tree = self.cache_manager, self.cache_manager.tree_cache
        return {
            "waiting": len(self.waiting_queue),
            "compiling": len(self.grammar_queue),
            "running": len(self.running),
            "free_kv": cache.allocator.available_size(),
            "evictable_kv": tree.evictable_size(),
            "protected_kv": tree.protected_size(),
            "generated": self.stats.generation_tokens,
            "prefilled": self.stats.prefill_tokens,
            "retractions": self.stats.num_retractions,
        }

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
                    self.process_batch_result(
                        batch, self._take_result(batch, self.run_batch(batch))
                    )
            send_outputs(self._take_outputs())

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
                launched = (batch, self.launch_batch(batch)) if batch is not None else None
                if launched is not None and self.forward_thread is not None:
                    self.forward_thread.wait_in_layers()  # see engine/sched/forward_thread.py
                self.resolve_in_flight()
                self.in_flight = launched
                if launched is None:
                    self.ratio.on_idle()
            send_outputs(self._take_outputs())

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

    def _take_outputs(self) -> list[Req]:
        outputs, self.outputs = self.outputs, []
        return outputs

    def launch_batch(self, batch: ScheduleBatch) -> Future[PendingResult]:
        """Start `batch` on the forward side without waiting for it: queued on the forward
        stream (CUDA), or run on the forward thread (CPU)."""
        if self.forward_thread is not None:
            return self.forward_thread.submit(self.run_batch, batch)
        if self.forward_stream is None:
            raise RuntimeError("launch_batch is the overlap loop's: overlap is off")
        stream = self.forward_stream
        # The batch's inputs were written on the scheduler's stream: order the forward
        # after them, and keep their memory from reuse until the forward stream is done.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        _record_stream(batch, stream)
        with torch.cuda.stream(stream):
            launched: Future[PendingResult] = Future()
            launched.set_result(self.run_batch(batch))
        return launched

    def resolve_in_flight(self) -> None:
        """Wait for the batch on the forward side and process its result."""
        if self.in_flight is not None:
            batch, future = self.in_flight
            self.in_flight = None
            self.process_batch_result(batch, self._take_result(batch, future.result()))

    def _take_result(self, batch: ScheduleBatch, pending: PendingResult) -> BatchResult:
        result = pending.result()
        if self.stats.observer is not None:
            self.stats.observer.on_forward(
                batch.forward_mode.name.lower(), len(batch.reqs), pending.forward_seconds()
            )
        return result

    def has_work(self) -> bool:
        return bool(
            self.waiting_queue
            or self.grammar_queue
            or self.running
            or self.chunked_req
            or self.in_flight
        )

    def shutdown(self) -> None:
        """Finish the batch a stopped overlap loop left in flight (its forward counts in the
        stats and the observer like any other), then stop the threads."""
        self.resolve_in_flight()
        if self.input_sync is not None:
            self.input_sync.stop()
        if self.forward_thread is not None:
            self.forward_thread.shutdown()
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
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if len(self.running) >= self.max_running_requests:
            return None
        in_flight_prefill = self.in_flight[0].reqs if self.in_flight is not None else []
        if self.chunked_req is not None:  # its later chunks are computing its prompt too
            in_flight_prefill = [*in_flight_prefill, self.chunked_req]
        chunk = self.chunked_prefill_size
        deferred = self.policy.calc_priority(self.waiting_queue, self.running, in_flight_prefill)
        mixed = (
            self.args.enable_mixed_chunk
            and bool(self.running)
            # half the turn's tokens at least stay the prefill's
            and 2 * len(self.running) <= (chunk or self.args.max_prefill_tokens)
            and self._decode_fits_without_eviction()
        )
        adder = PrefillAdder(
            self.cache_manager,
            self.running,
            self.ratio.new_token_ratio,
            self.args.clip_max_new_tokens,
            self.args.max_prefill_tokens,
            chunk,
            mixed_with_decode_tokens=len(self.running) if mixed else 0,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        adapters = self._running_adapters()
        for req in self.waiting_queue:
            if req.rid in deferred or not self._adapter_fits(req, adapters):
                continue  # its adapter waits for a slot: it never fails for that
            if (
                len(self.running) + len(adder.can_run_list) >= self.max_running_requests
                or adder.budget_exhausted()
            ):
                break
            self.cache_manager.match_req(req)
            result = adder.add_one_req(req)
            if req.lora_name is not None and adder.can_run_list[-1:] == [req]:
                adapters.add(req.lora_name)
            if result is not AddReqResult.CONTINUE:
                break
        if not adder.can_run_list:
            return None

        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for req in adder.can_run_list:
            if req.cached_tokens is None:  # first admission: count the radix hit once
                req.cached_tokens = len(req.prefix_indices)
                self.stats.cache_hit_tokens += len(req.prefix_indices)
                self.stats.cache_query_tokens += len(req.origin_input_ids)
                if self.stats.observer is not None:
                    self.stats.observer.on_admit(req)
            req.status = ReqStatus.RUNNING
            self.stats.prefill_tokens += req.extend_input_len
        self.chunked_req = adder.new_chunked_req
        batch = self._prepare(adder.can_run_list, with_decodes=mixed)
        self.running.add([r for r in adder.can_run_list if not r.is_chunked])
        return batch

    def move_ready_grammar_requests(self) -> None:
        """Compiled requests join the waiting queue; a failed or timed-out compile fails its
        request alone with a 400. Waits briefly for a compile when nothing else can run."""
        if not (self.waiting_queue or self.running or self.chunked_req or self.in_flight):
            pending = [_pending_grammar(r).future for r in self.grammar_queue]
            wait(pending, timeout=GRAMMAR_POLL_INTERVAL_S, return_when=FIRST_COMPLETED)
        still_compiling: list[Req] = []
        ready: list[str] = []
        failed: list[tuple[str, FinishReason]] = []
        for req in self.grammar_queue:
            try:
                compiled = _pending_grammar(req).result()
            except GrammarError as e:
                self._finish(req, FinishReason("abort", message=str(e), status_code=400))
            except Exception as e:
                self._fail(req, "compiling its grammar", e)
            else:
                if compiled is None:
                    still_compiling.append(req)
                elif self._take_grammar(req, compiled):
                    ready.append(req.rid)
                continue
            assert req.finished_reason is not None, "finished just above"
            failed.append((req.rid, req.finished_reason))
        self.grammar_queue = still_compiling
        if self.input_sync is not None and (ready or failed):
            self.input_sync.record(GrammarsDone(ready, failed))

    def follow_grammar_queue(self, ready: list[str], failed: dict[str, FinishReason]) -> None:
        """A rank other than 0 takes rank 0's word on which compiles ended and how (when
        one ends depends on thread timing): the failed finish with rank 0's reason, the
        ready join the waiting queue in rank 0's order, waiting for their compile here."""
        by_rid = {req.rid: req for req in self.grammar_queue}
        self.grammar_queue = [
            r for r in self.grammar_queue if r.rid not in failed and r.rid not in ready
        ]
        for rid, reason in failed.items():
            self._finish(by_rid[rid], reason)
        for rid in ready:
            req = by_rid[rid]
            try:
                compiled = _pending_grammar(req).future.result()
            except Exception as e:
                self._fail(req, "compiling its grammar", e)
                continue
            self._take_grammar(req, compiled)

    def _take_grammar(self, req: Req, compiled: Any) -> bool:
        """Give `req` its matcher and queue it; False if making the matcher failed it."""
        try:
            req.grammar = self._grammar_backend().new_matcher(
                compiled, req.sampling_params.reasoning
            )
        except Exception as e:
            self._fail(req, "compiling its grammar", e)
            return False
        req.pending_grammar = None
        self.waiting_queue.append(req)
        return True

    def update_running_batch(self) -> ScheduleBatch | None:
        """A decode step for every running request, making room first: evict cache, then
        retract (after the in-flight batch is processed, so nothing retracted is in flight)."""
        if not self.cache_manager.make_room(len(self.running)):
            self.resolve_in_flight()
            if not self.running:
                return None
            if not self.cache_manager.make_room(len(self.running)):
                self._retract()
                if not self.running:
                    return None
        else:
            self.ratio.on_decode_step()
        return self._prepare([], with_decodes=True)

    def _retract(self) -> None:
        result = retract_decode(self.running.reqs, self.cache_manager)
        kept = {id(r) for r in result.kept}
        self.running.keep([i for i, r in enumerate(self.running.reqs) if id(r) in kept])
        self.waiting_queue[:0] = result.retracted
        for req in result.retracted:
            self.stats.num_retractions += 1
            self.stats.retracted_input_tokens += len(req.origin_input_ids)
            self.stats.retracted_output_tokens += len(req.output_ids)
        if result.aborted is not None:
            self.outputs.append(result.aborted)
        if result.kept:
            self.ratio.on_retract(result.kept)
        logger.info(
            "retracted %d request(s); new_token_ratio %.3f",
            len(result.retracted),
            self.ratio.new_token_ratio,
        )

    def _decode_fits_without_eviction(self) -> bool:
        return self.cache_manager.allocator.available_size() >= len(self.running)

    def _prepare(self, extend_reqs: list[Req], with_decodes: bool) -> ScheduleBatch | None:
        """The batch of `extend_reqs` and, `with_decodes`, a decode step of the running batch."""
        if self.in_flight is not None and (
            any(_needs_output_history(r) for r in extend_reqs)
            or (
                with_decodes
                and self.running.num_req_state
                and any(_needs_output_history(r) for r in self.running)
            )
        ):
            # Penalties, min_new_tokens, seeded sampling and grammars read the output so far
            # on the CPU side; wait for the in-flight batch rather than use a stale history
            # (which finishes, or jumps forward, some running requests).
            self.resolve_in_flight()
        if not extend_reqs and not (with_decodes and self.running):
            return None
        if self.lora is not None and self.in_flight is not None:
            names = [r.lora_name for r in extend_reqs]
            names += [r.lora_name for r in self.running] if with_decodes else []
            if self.lora.needs_swap(names):  # the in-flight batch may read the slot
                self.resolve_in_flight()
        batch = ScheduleBatch.prepare(
            extend_reqs,
            self.running if with_decodes else None,
            self.cache_manager,
            self.model_runner.token_to_kv_pool,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
        )
        if self.lora is not None:
            batch.forward_batch.lora_slots = self._lora_slots(self.lora, batch)
        mode = batch.forward_mode.name.lower()
        self.stats.forward_modes[mode] = self.stats.forward_modes.get(mode, 0) + 1
        return batch

    # ----- LoRA adapters ----------------------------------------------------------------

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError(
                "LoRA is off: start with --lora-paths or --enable-lora-runtime-update",
                param="lora_name",
            )
        return self.lora

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load an adapter at run time (only under --enable-lora-runtime-update, from under
        --lora-root); raises LoRAError, leaving what serves untouched."""
        manager = self._lora_manager()
        if not self.args.enable_lora_runtime_update:
            raise LoRAError(
                "loading adapters at run time needs --enable-lora-runtime-update",
                param="lora_name",
            )
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.lora_roots):
            raise LoRAError(f"lora_path {path!r} is not under --lora-root {self.lora_roots}")
        manager.load(name, path)
        if self.input_sync is not None:
            self.input_sync.record(LoadLoRA(name, path))

    def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter and free its cached prefixes; 409 while a request uses it."""
        manager = self._lora_manager()
        if not self.args.enable_lora_runtime_update:
            raise LoRAError(
                "unloading adapters at run time needs --enable-lora-runtime-update",
                param="lora_name",
            )
        if name not in manager.adapters:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded", 404, "lora_name")
        if any(req.lora_name == name for req in self._live_reqs()):
            raise LoRAError(f"LoRA adapter {name!r} has requests in flight", 409, "lora_name")
        self.resolve_in_flight()  # a finished batch of it may still be in flight
        tree = self.cache_manager.tree_cache
        if isinstance(tree, RadixCache):
            tree.evict_namespace(PrefixNamespace(lora=name))
        manager.unload(name)
        if self.input_sync is not None:
            self.input_sync.record(UnloadLoRA(name))

    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        if self.lora is None:
            return {}
        return {name: adapter.path for name, adapter in self.lora.adapters.items()}

    def lora_info(self) -> tuple[list[str], list[str]]:
        """(adapters of running requests, adapters of waiting ones), for the metrics."""
        running = {r.lora_name for r in self.running} | (
            {self.chunked_req.lora_name} if self.chunked_req is not None else set()
        )
        waiting = {r.lora_name for r in (*self.waiting_queue, *self.grammar_queue)}
        return sorted(n for n in running if n), sorted(n for n in waiting if n)

    def _live_reqs(self) -> list[Req]:
        """Every request not finished: waiting, compiling, chunked or running."""
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        return [*self.waiting_queue, *self.grammar_queue, *chunked, *self.running]

    def _running_adapters(self) -> set[str]:
        """Adapters the next batch holds slots for already: running and chunked requests'."""
        if self.lora is None:
            return set()
        names = {r.lora_name for r in self.running if r.lora_name is not None}
        if self.chunked_req is not None and self.chunked_req.lora_name is not None:
            names.add(self.chunked_req.lora_name)
        return names

    def _adapter_fits(self, req: Req, adapters: set[str]) -> bool:
        """Whether `req` can join a batch already naming `adapters` (slots are finite)."""
        if req.lora_name is None or req.lora_name in adapters or self.lora is None:
            return True
        return len(adapters) < self.lora.num_slots

    def _lora_slots(self, manager: LoRAManager, batch: ScheduleBatch) -> torch.Tensor | None:
        """Each request's adapter slot id, or None when no request of the batch has one."""
        names = [r.lora_name for r in batch.reqs]
        if not any(names):
            return None
        slots = torch.tensor(manager.acquire(names), dtype=torch.int64)
        return slots.to(self.device, non_blocking=True)

    # ----- the forward side -------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> PendingResult:
        """Forward and sample, and start copying the tokens to the host; wait for nothing.
        Under the overlap loop it touches only the batch's own tensors, the KV pool and the
        FutureMap (on the forward thread on CPU, the forward stream on CUDA)."""
        started = time.perf_counter()
        start_event = None
        if self.device.type == "cuda":
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        forward_batch = batch.forward_batch
        if self.stats.observer is not None and not forward_batch.forward_mode.is_decode():
            forward_batch.on_layer_end = self.stats.observer.on_progress
        if self.future_map.debug:  # its poison check syncs: not for a graph
            forward_batch.input_ids = self.future_map.resolve(forward_batch.input_ids)
            logits_output = self.model_runner.forward_output(forward_batch)
        else:  # resolved inside the forward, so inside a decode graph
            logits_output = self.model_runner.forward_output(
                forward_batch, resolve_input_ids=self.future_map.resolve
            )
        out = self._agree_on_tokens(
            batch, self.sampler(logits_output.next_token_logits, batch.sampling_info)
        )
        self.future_map.store(forward_batch.req_pool_indices, out.next_token_ids)
        return PendingResult(
            out, logits_output, forward_batch.prompt_logprobs, started, start_event
        )

    def _agree_on_tokens(self, batch: ScheduleBatch, out: SamplerOutput) -> SamplerOutput:
        """At TP > 1 every rank samples from the same (all-gathered) logits. Greedy rows
        agree by construction, so a batch of them costs nothing more; a batch with a
        sampled or grammar-masked row takes rank 0's ids (one all-gather of B ids on the
        device group, in stream order: no host sync). Seeding every rank alike would
        agree too, but only while no rank's RNG is ever drawn differently: the broadcast
        makes agreement a fact, not a hope."""
        info = batch.sampling_info
        if self.tp_group.size == 1 or (info.is_all_greedy and info.vocab_mask is None):
            return out
        ids = self.tp_group.all_gather(out.next_token_ids[None], dim=0)[0]
        return out._replace(next_token_ids=ids)

    # ----- results ----------------------------------------------------------------------

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        """Commit each request's new KV, append its sampled token and end, cache or send it.

        A batch's prefill rows come first and take `_process_extend`; its decode rows are
        most of the work at large batches, so a plain decode (no logprobs, grammar or stop
        strings) that neither hits a stop token nor reaches its length takes a short path
        of a few attribute reads and one set lookup."""
        num_extend = batch.num_extend_reqs
        reqs, tokens = batch.reqs, result.next_token_ids
        done: list[Req] = []  # leaving the running batch: finished or jumped forward
        for req, error in batch.faults:  # its row sampled unconstrained: the token is void
            if not req.finished:
                done.append(req)
                self._fail(req, "masking its grammar's tokens", error)
        generated = 0
        for i in range(num_extend):
            generated += self._process_extend(batch, result, i, done)
        commit, outputs = self.cache_manager.commit, self.outputs
        for i in range(num_extend, len(reqs)):
            req = reqs[i]
            if req.finished:
                continue  # finished or aborted while this batch ran; its KV is already freed
            commit(req, 1)
            token = tokens[i]
            output_ids = req.output_ids
            output_ids.append(token)
            generated += 1
            if (
                req.plain_decode
                and token not in req.stop_ids
                and len(output_ids) < req.sampling_params.max_new_tokens
            ):
                outputs.append(req)
            elif self._after_token(req, result, i, token):
                done.append(req)
        self.stats.generation_tokens += generated
        self.running.remove(done)

    def _process_extend(
        self, batch: ScheduleBatch, result: BatchResult, i: int, done: list[Req]
    ) -> int:
        """Row `i`, a prefill (or its last chunk); the number of tokens it generated."""
        req = batch.reqs[i]
        if req.finished:
            return 0
        self.cache_manager.commit(req, batch.extend_lens[i])
        if req.prompt_logprobs_pending:
            try:
                _add_prompt_logprobs(req, result, i)
            except Exception as e:
                done.append(req)
                self._fail(req, "gathering its prompt logprobs", e)
                return 0
        if id(req) in batch.chunked:
            self.cache_manager.cache_unfinished_req(req)
            return 0
        if req.sampling_params.max_new_tokens == 0:  # a prefill alone: nothing to sample
            self.cache_manager.cache_finished_req(req)
            self._finish(req, FinishReason("length"))
            done.append(req)
            return 0
        token = result.next_token_ids[i]
        req.output_ids.append(token)
        if self._after_token(req, result, i, token, fresh_prefill=True):
            done.append(req)
        return 1

    def _after_token(
        self, req: Req, result: BatchResult, i: int, token: int, fresh_prefill: bool = False
    ) -> bool:
        """Record the logprobs of the token just appended at row `i`, advance the grammar,
        and end the request or send it on; True if it leaves the running batch.

        What runs the request's own logprobs, grammar, stop strings or jump-forward plan is
        contained: an error there fails this request alone (`_fail`) and the batch goes on.
        The KV hand-overs stay outside the guard: an error in them is the scheduler's own."""
        grammar = req.grammar
        try:
            reason = self._advance(req, result, i, token)
            plan = (
                self._plan_jump_forward(req, grammar)
                if reason is None and self.jump_forward and grammar is not None
                else None
            )
        except Exception as e:
            return self._fail(req, "processing its sampled token", e)
        if reason is not None:
            self.cache_manager.cache_finished_req(req)
            self._finish(req, reason)
            return True
        if fresh_prefill:  # share the fresh prefill with later requests now
            self.cache_manager.cache_unfinished_req(req)
        self.outputs.append(req)
        if plan is None:
            return False
        self._jump_forward(req, plan)
        return True

    def _advance(self, req: Req, result: BatchResult, i: int, token: int) -> FinishReason | None:
        """Record row `i`'s logprobs of the token just appended and advance the grammar;
        why the request ends now, if it does."""
        params = req.sampling_params
        if params.logprobs:
            logprobs, top_logprobs = result.next_token_logprobs, result.top_logprobs
            assert logprobs is not None, "the sampler returns logprobs when a request asks"
            req.output_token_logprobs.append((logprobs[i], token))
            if params.top_logprobs_num:
                assert top_logprobs is not None, "as for logprobs"
                req.output_top_logprobs.append(top_logprobs[i][: params.top_logprobs_num])
        grammar = req.grammar
        reason = _accept_grammar_token(grammar, token) if grammar is not None else None
        return reason or self._check_finished(req)

    def _plan_jump_forward(self, req: Req, matcher: AnyGrammarMatcher) -> JumpForward | None:
        """The tokens of the text the grammar forces now, with the matcher already moved
        onto them; None (matcher unchanged) when there is nothing to take."""
        params = req.sampling_params
        forced = matcher.find_jump_forward_string()
        if not forced or params.logprobs:  # forced tokens have no sampled logprobs to report
            return None
        plan = plan_jump_forward(self._grammar_backend().tokenizer, req.output_ids, forced)
        if plan is None:
            return None
        new_len = len(req.output_ids) - plan.rollback + len(plan.token_ids)
        if (
            new_len >= params.max_new_tokens
            or len(req.origin_input_ids) + new_len >= self.context_len
        ):
            return None  # the forced text would end the request: decode up to the limit
        if params.stop and self._forced_text_hits_stop(req, forced):
            return None  # decode it token by token, so that the stop check ends the request
        if not _retokenize_grammar(matcher, req.output_ids, plan):
            return None
        return plan

    def _jump_forward(self, req: Req, plan: JumpForward) -> None:
        """Take the forced tokens of `plan`. The request leaves the running batch (the
        caller removes it) with its KV handed to the radix tree and returns through the
        waiting queue as an extend of the forced tokens: one forward pass instead of one
        per token. Under the overlap loop nothing of it is in flight here: `_prepare`
        resolved its last batch before building the next, as for every grammar request."""
        self.cache_manager.cache_finished_req(req)
        del req.output_ids[len(req.output_ids) - plan.rollback :]
        req.output_ids += plan.token_ids
        req.output_rollback = plan.rollback
        req.status = ReqStatus.WAITING
        self.waiting_queue.insert(0, req)
        self.stats.jump_forwards += 1
        self.stats.jump_forward_tokens += len(plan.token_ids) - plan.rollback

    def _forced_text_hits_stop(self, req: Req, forced: str) -> bool:
        stop = req.sampling_params.stop
        tail = req.output_ids[-max(len(s) for s in stop) :]
        decoded = self._grammar_backend().tokenizer.decode(tail, skip_special_tokens=False)
        assert isinstance(decoded, str), "a flat id list decodes to one string"
        return any(s in decoded + forced for s in stop)

    def _grammar_backend(self) -> GrammarBackend:
        """The backend, there whenever a request has a grammar (`add_request` checks)."""
        if self.grammar_backend is None:
            raise RuntimeError("a grammar request reached a scheduler without a grammar backend")
        return self.grammar_backend

    def _check_finished(self, req: Req) -> FinishReason | None:
        params = req.sampling_params
        num_output = len(req.output_ids)
        if num_output >= params.max_new_tokens:
            return FinishReason("length")
        if num_output >= params.min_new_tokens:
            token = req.output_ids[-1]
            if token in req.stop_ids:
                return FinishReason("stop", matched=token)
            if params.stop and self.stop_string_checker is not None:
                matched = self.stop_string_checker(req)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if len(req.origin_input_ids) + num_output >= self.context_len:
            return FinishReason("length")
        return None

    def _fail(self, req: Req, stage: str, error: Exception) -> bool:
        """Contain an error raised while handling `req` alone: log it once with its
        traceback, free its KV without caching it, and finish it with a server error that
        the client sees; the loop serves the other requests on. True: like any finished
        request it leaves the running batch (the caller removes it)."""
        logger.error("request %s failed while %s", req.rid, stage, exc_info=error)
        if req is self.chunked_req:
            self.chunked_req = None
        if req.req_pool_idx is not None:
            release_req(req, self.cache_manager)
        message = (
            f"internal server error while {stage} ({type(error).__name__}); "
            "the request was stopped, and the server serves other requests on"
        )
        self._finish(req, FinishReason("abort", message=message))
        return True

    def _finish(self, req: Req, reason: FinishReason) -> None:
        """Mark `req` finished and send it; a running request's caller also removes it from
        the running batch (once per batch, for all that finish in it)."""
        req.finish(reason)
        self.outputs.append(req)


def _accept_grammar_token(matcher: AnyGrammarMatcher, token: int) -> FinishReason | None:
    """Advance the matcher; a terminated grammar ends the request, its stop token (the
    model's EOS) counting as the matched stop token."""
    if not matcher.accept_token(token):
        if not matcher.allows_any_token():  # every token was masked: the draw was arbitrary
            return FinishReason(
                "abort",
                message="no token of the model's vocabulary can continue the json_schema, "
                "regex or ebnf here: it needs text this tokenizer cannot produce",
                status_code=400,
            )
        # The mask allowed only grammar tokens, so this is a bug, not the client's fault.
        return FinishReason("abort", message=f"token {token} was sampled outside the grammar")
    if matcher.is_terminated():
        return FinishReason("stop", matched=token)
    return None


def _retokenize_grammar(
    matcher: AnyGrammarMatcher, output_ids: list[int], plan: JumpForward
) -> bool:
    """Move the matcher onto the re-encoded tokens; False (matcher unchanged) if it refuses
    one, which only a special token inside the forced text could cause."""
    replaced = output_ids[len(output_ids) - plan.rollback :]
    matcher.rollback(plan.rollback)
    for n, token in enumerate(plan.token_ids):
        if not matcher.accept_token(token):
            matcher.rollback(n)
            for old in replaced:
                matcher.accept_token(old)
            return False
    return True


def _pending_grammar(req: Req) -> PendingGrammar:
    """The compile a request in the grammar queue waits for."""
    if req.pending_grammar is None:
        raise RuntimeError(f"request {req.rid} is in the grammar queue without a compile")
    return req.pending_grammar


def _add_prompt_logprobs(req: Req, result: BatchResult, i: int) -> None:
    """Append what batch row `i` computed of `req`'s prompt logprobs; position 0, which
    nothing predicts, is None and comes first."""
    params = req.sampling_params
    if not req.input_token_logprobs and params.logprob_start_len == 0:
        req.input_token_logprobs.append(None)
        if params.prompt_top_logprobs_num:
            req.input_top_logprobs.append([])
    if result.input_token_logprobs is not None:
        req.input_token_logprobs += result.input_token_logprobs[i]
    if params.prompt_top_logprobs_num and result.input_top_logprobs is not None:
        k = params.prompt_top_logprobs_num
        req.input_top_logprobs += [top[:k] for top in result.input_top_logprobs[i]]


def after_turns(num_turns: int) -> ShouldStop:
    """A `should_stop` that ends an event loop after `num_turns` turns, for callers that do
    work of their own between turns (the offline stream yields after each)."""
    turns = itertools.count()
    return lambda: next(turns) >= num_turns


def _needs_output_history(req: Req) -> bool:
    params = req.sampling_params
    return bool(
        params.frequency_penalty
        or params.presence_penalty
        or params.repetition_penalty != 1.0
        or len(req.output_ids) < params.min_new_tokens
        or (params.seed is not None and not params.is_greedy)
        or req.grammar is not None
    )


def _record_stream(batch: ScheduleBatch, stream: torch.cuda.Stream) -> None:
    """Mark the batch's device tensors as used on `stream`, so that the caching allocator
    does not hand their memory out again before the forward stream has read them."""
    for holder in (batch.forward_batch, batch.sampling_info, batch.forward_batch.prompt_logprobs):
        for value in vars(holder).values() if holder is not None else ():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                value.record_stream(stream)
