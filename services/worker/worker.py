"""The worker: the engine's scheduler behind a ZMQ loop.

The worker's loop is the scheduler's event loop (normal or overlap): it polls the sockets
at the start of each turn and sends the turn's outputs at its end. Requests arrive from
the tokenizer already tokenized; each turn's new tokens go to the detokenizer as one
`BatchTokenIDOutput` (a request's constants, its stop strings and decode options,
ride once, in the first batch that carries it; a batch too large for one message goes as
several, and a request whose own row is too large fails alone), and control replies (ready, flush,
server info) go straight back to the tokenizer on the control socket. Once the model is
loaded the worker serves `/metrics` and `/healthz` on its metrics port, and a traced
request gets its queue-wait, prefill and decode spans when it finishes.

On a CPU device the worker says once at start which instruction sets the CPU has and which
kernel path runs (`cpu_isa`), with the dtype and the weights' format; the same shows as
`radixserve_cpu_info` and in `/get_server_info` (`cpu_isa`, `cpu_flags`). On CUDA the path is
reported as "cuda" and no CPU flags: the CPU's instruction sets do not run the model there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import zmq

from engine.build import build
from engine.cache.kv_events import BlockEventRecorder
from engine.kernels.cpu.isa import CpuIsa, cpu_isa
from engine.lora import LoRAError
from engine.sched.req import FinishReason, Req
from observability.worker_metrics import CpuInfo, WorkerMetrics, WorkerSample
from services.io_struct import (
    FRAME_HEADROOM_BYTES,
    AbortReq,
    BatchTokenIDOutput,
    DetokenizerReqState,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    Message,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    WorkerReady,
    split_batch,
)
from services.ipc import MAX_MESSAGE_BYTES, PeerEvent
from services.process import Service
from services.settings import Settings
from services.worker.kv_event_publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)

METRICS_SAMPLE_INTERVAL_S = 0.25
"""How often the loop copies the scheduler's counters for scrapes: fresh, and cheap."""


class _Entry(NamedTuple):
    """One request's column entry in an output batch."""

    req: Req
    start: int
    """The entry's output ids start here: those the detokenizer has not seen, or replace."""
    rollback: int
    """How many ids it saw a jump-forward replaced (the entry's first `rollback` ids)."""
    trace_context: dict[str, str]
    prompt_logprobs: bool = False
    """The entry carries the request's prompt logprobs (once, when its prefill completes)."""
    first: bool = True
    """The request's first output: the batch carries its `DetokenizerReqState`."""


@dataclass
class _ReqState:
    """What the worker remembers of a live request beyond the scheduler's `Req`."""

    tokenizer_epoch: str
    """The tokenizer life that sent it: a restarted tokenizer has no client for it."""
    trace_context: dict[str, str] = field(default_factory=dict)
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    """First admission into a batch (time.monotonic(), as all times here)."""
    first_token: float | None = None
    prompt_logprobs_sent: bool = False
    """Its prompt logprobs went out (they go once, in the first output after the prefill)."""
    announced: bool = False
    """Its `DetokenizerReqState` went out (once, with its first output)."""


class Worker(Service):
    role = "worker"

    def __init__(self, settings: Settings):
        # Load before binding: until the model is in memory there is nobody to send
        # heartbeats, and a tokenizer pushing requests meanwhile gets a clear refusal
        # (IMMEDIATE) instead of a queue that nobody drains.
        started = time.monotonic()
        self.core = build(settings.to_engine_args())
        self.scheduler = self.core.scheduler
        logger.info(
            "engine ready in %.1f s: %s, max_total_tokens=%d context_length=%d "
            "max_running_requests=%d device=%s tp_size=%d",
            time.monotonic() - started,
            settings.model,
            self.scheduler.max_total_tokens,
            self.scheduler.context_len,
            self.scheduler.max_running_requests,
            self.scheduler.device,
            settings.tp_size,
        )
        runner = self.core.model_runner
        self.cpu_isa: CpuIsa | None = cpu_isa() if runner.device.type == "cpu" else None
        """The CPU's instruction sets and kernel path; None on an accelerator."""
        self.cpu_info = CpuInfo(
            isa=runner.device.type if self.cpu_isa is None else self.cpu_isa.path,
            dtype=str(runner.dtype).removeprefix("torch."),
            weights=runner.weights_format,
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            deterministic=str(runner.deterministic).lower(),
        )
        if self.cpu_isa is not None:
            logger.info(
                "CPU: %s, dtype %s, weights %s, KV cache %s, deterministic %s",
                self.cpu_isa.describe(),
                self.cpu_info.dtype,
                self.cpu_info.weights,
                self.cpu_info.kv_cache_dtype,
                self.cpu_info.deterministic,
            )
        super().__init__(settings, settings.zmq_address("worker_port"))
        self.to_detokenizer = self.outbox(settings.zmq_address("detokenizer_port"))
        self.max_output_bytes = MAX_MESSAGE_BYTES - FRAME_HEADROOM_BYTES
        """An output batch encoding to more is split by rows (`split_batch`)."""
        self.to_tokenizer = self.connect(settings.zmq_address("tokenizer_control_port"))
        self.live: dict[str, _ReqState] = {}
        """rid → state of each request queued or running in the scheduler."""
        self.rejected: list[Req] = []
        """Requests refused at submission, reported with the next output batch."""
        self.ready_pending = True
        """WorkerReady is owed to the tokenizer: not yet delivered, or the tokenizer restarted."""
        self.model_name = settings.model_id
        self.speculative = settings.speculative_algorithm is not None
        """Output batches carry the per-request speculative columns (`spec_verify_ct`)."""
        max_lora = settings.max_loras_per_batch if settings.enable_lora else 0
        self.metrics = WorkerMetrics(self.registry, self.model_name, max_lora, self.cpu_info)
        self.scheduler.observe(self)
        self.kv_events, self.kv_publisher = self._start_kv_events(settings)
        self.metrics.publish(self.sample())
        self.next_sample = 0.0
        # Only now: a startupProbe on /healthz must not pass before the model is loaded.
        self.serve_metrics(settings.worker_metrics_port)

    # ----- the loop -----------------------------------------------------------------------

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """The scheduler's event loop, polling the sockets once a turn."""
        self.scheduler.run_event_loop(should_stop, self.poll, self.send_outputs)

    def has_work(self) -> bool:
        """The scheduler has work, or outputs wait to be sent: the poll then waits for none."""
        return bool(
            self.scheduler.has_work() or self.scheduler.output_processor.outputs or self.rejected
        )

    def poll(self) -> None:
        if self.ready_pending:
            self.send_ready()
        super().poll()
        if self.last_turn >= self.next_sample:
            self.metrics.publish(self.sample())
            self.next_sample = self.last_turn + METRICS_SAMPLE_INTERVAL_S

    def send_outputs(self, reqs: list[Req]) -> None:
        """One output message per turn for everything that advanced, finished (aborts
        included) or was rejected."""
        entries = [_Entry(req, 0, 0, {}) for req in self.rejected]
        self.rejected = []
        # Under the overlap loop a req can advance and then be retracted-and-aborted in one turn.
        outputs = {id(r): r for r in reqs}.values()
        now = time.monotonic()
        for req in outputs:
            state = self.live.get(req.rid)
            if state is None:
                continue  # an output too large to send failed it: that went out already
            if state.first_token is None and req.output_ids:
                state.first_token = now
            start, rollback = req.read_output()
            prompt_logprobs = req.prompt_logprobs_ready and not state.prompt_logprobs_sent
            state.prompt_logprobs_sent |= prompt_logprobs
            entries.append(
                _Entry(
                    req,
                    start,
                    rollback,
                    state.trace_context if req.finished else {},
                    prompt_logprobs,
                    first=not state.announced,
                )
            )
            state.announced = True
            if req.finished:
                del self.live[req.rid]
                if self.tracing is not None:
                    self.trace_finished(req, state, now)
        if entries:
            self.send_batch_output(entries)
        self.publish_kv_events()

    # ----- KV-cache events --------------------------------------------------------------

    def _start_kv_events(
        self, settings: Settings
    ) -> tuple[BlockEventRecorder | None, ZmqEventPublisher | None]:
        """With `--kv-events-config`, record the tree's blocks and publish them; the first
        batch is the start-up `AllBlocksCleared`."""
        config = settings.kv_events()
        if config is None:
            return None, None
        publisher = ZmqEventPublisher(config)
        recorder = BlockEventRecorder(settings.kv_events_block_size)
        self.scheduler.cache_manager.tree_cache.attach_kv_events(recorder)
        publisher.publish(recorder.take())
        return recorder, publisher

    def publish_kv_events(self) -> None:
        if self.kv_events is not None and self.kv_publisher is not None:
            self.kv_publisher.publish(self.kv_events.take())

    # ----- what the scheduler tells its observer ----------------------------------------

    def on_admit(self, req: Req) -> None:
        state = self.live.get(req.rid)
        if state is not None:
            state.admitted = time.monotonic()
            self.metrics.queue_time.observe(state.admitted - state.arrived)

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        self.metrics.observe_forward(mode, batch_size, seconds)

    def on_progress(self) -> None:
        self.mark_progress()

    def on_grammar_compile(self, seconds: float | None) -> None:
        self.metrics.observe_grammar_compile(seconds)

    def on_peer_event(self, event: PeerEvent) -> None:
        if event.peer != "tokenizer" or event.kind == "dead":
            return
        # A tokenizer that is new or restarted must learn the limits (its /health waits on it).
        self.ready_pending = True
        if event.kind == "restart":
            # Its clients went with its previous life: nobody will read these outputs.
            orphans = [
                rid for rid, state in self.live.items() if state.tokenizer_epoch != event.epoch
            ]
            if orphans:
                logger.info(
                    "tokenizer restarted; aborting %d request(s) of its previous life", len(orphans)
                )
            for rid in orphans:
                self.scheduler.abort_request(rid)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            if msg.rid in self.live:
                self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            self.to_tokenizer.send(self.flush_cache(msg.rid))
        elif isinstance(msg, GetServerInfoReq):
            info = self.server_info()
            if msg.check_integrity:
                info["radix_integrity"] = self.check_integrity()
            self.to_tokenizer.send(GetServerInfoReqOutput(info=info, rid=msg.rid))
        elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
            self.to_tokenizer.send(self.update_lora(msg))
        else:
            logger.warning(
                "dropped a %s from %s: not a worker message", type(msg).__name__, msg.sender or "?"
            )

    # ----- requests ---------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req.of(msg)
        state = _ReqState(msg.epoch, trace_context=msg.trace_context)
        try:
            if msg.rid in self.live:
                raise ValueError(f"request id {msg.rid!r} is already in use")
            self.scheduler.add_request(req)
        except ValueError as e:  # a LoRAError's status: 404 for an adapter unloaded meanwhile
            status = e.status if isinstance(e, LoRAError) else 400
            req.finish(FinishReason("abort", message=str(e), status_code=status))
            self.rejected.append(req)
            logger.info("rejected request %s: %s", msg.rid, e)
            return
        except Exception as e:  # a bug met by this request's parameters: fail it alone
            logger.exception("request %s failed at submission", msg.rid)
            message = f"internal server error while submitting the request ({type(e).__name__})"
            req.finish(FinishReason("abort", message=message))
            self.rejected.append(req)
            return
        self.live[msg.rid] = state
        if msg.lora_name is not None:
            self.metrics.observe_lora_request(msg.lora_name)

    def send_batch_output(self, entries: list[_Entry]) -> None:
        """One column entry per request: the output ids the detokenizer has not seen yet, or
        that replace ids a jump-forward rolled back (with the count in `rollbacks`)."""
        want_logprobs = any(e.req.sampling_params.logprobs for e in entries)
        want_top = any(e.req.sampling_params.top_logprobs_num for e in entries)
        contexts = [e.trace_context for e in entries]
        logprobs: list[list[float]] = []
        top_val: list[list[list[float]]] = []
        top_idx: list[list[list[int]]] = []
        for req, start, *_ in entries:
            params = req.sampling_params
            if want_logprobs:
                logprobs.append(
                    [lp for lp, _ in req.output_token_logprobs[start:]] if params.logprobs else []
                )
            if want_top:
                top = req.output_top_logprobs[start:] if params.top_logprobs_num else []
                top_val.append([[lp for lp, _ in entry] for entry in top])
                top_idx.append([[tid for _, tid in entry] for entry in top])
        prompt = _prompt_logprob_columns(entries)
        out = BatchTokenIDOutput(
            rids=[e.req.rid for e in entries],
            output_ids=[e.req.output_ids[e.start :] for e in entries],
            finished_reasons=[e.req.finished_reason for e in entries],
            prompt_tokens=[len(e.req.origin_input_ids) for e in entries],
            completion_tokens=[len(e.req.output_ids) for e in entries],
            cached_tokens=[e.req.cached_tokens or 0 for e in entries],
            new_reqs=[_detokenizer_state(e.req) for e in entries if e.first],
            output_token_logprobs_val=logprobs if want_logprobs else None,
            output_top_logprobs_val=top_val if want_top else None,
            output_top_logprobs_idx=top_idx if want_top else None,
            sender=self.role,  # stamped now: `split_batch` measures what is sent
            epoch=self.epoch,
            trace_contexts=contexts if any(contexts) else None,
            rollbacks=[e.rollback for e in entries] if any(e.rollback for e in entries) else None,
            input_token_logprobs_val=prompt.input_token_logprobs_val,
            input_top_logprobs_val=prompt.input_top_logprobs_val,
            input_top_logprobs_idx=prompt.input_top_logprobs_idx,
            spec_verify_ct=[e.req.spec_verify_ct for e in entries] if self.speculative else None,
            spec_accept_length=(
                [e.req.spec_accept_length for e in entries] if self.speculative else None
            ),
        )

        def fail(row: int, size: int) -> FinishReason:
            return self.fail_oversized(entries[row].req, size)

        for part in split_batch(out, self.max_output_bytes, fail):
            self.to_detokenizer.put(part)

    def fail_oversized(self, req: Req, size: int) -> FinishReason:
        """Fail `req`, whose row of an output batch alone encodes to `size` bytes, over the
        frame limit: it is aborted (its KV freed) and its emptied row carries the reason.
        Its later outputs are not sent (it is no longer live)."""
        message = (
            f"this request's output of one step encodes to {size} bytes, over the "
            f"{self.max_output_bytes}-byte limit of a message between the server's "
            "processes; ask for fewer logprobs or prompt logprobs, or shorter stop strings"
        )
        logger.error("request %s failed: %s", req.rid, message)
        self.live.pop(req.rid, None)
        if not req.finished:
            self.scheduler.abort_request(req.rid, FinishReason("abort", None, message, 400))
        return FinishReason("abort", None, message, 400)

    def trace_finished(self, req: Req, state: _ReqState, now: float) -> None:
        """The request's worker spans, from the times kept while it ran: queue wait until
        its first admission, prefill until its first token, decode until now."""
        tracing, carrier, reason = self.tracing, state.trace_context, req.finished_reason
        if tracing is None or reason is None:
            return
        error = (reason.message or "aborted") if reason.type == "abort" else None
        attributes = {"radixserve.rid": req.rid}
        if state.admitted is None:
            tracing.record("queue_wait", carrier, state.arrived, now, error, **attributes)
            return
        tracing.record("queue_wait", carrier, state.arrived, state.admitted, **attributes)
        first_token = state.first_token or now
        tracing.record(
            "prefill",
            carrier,
            state.admitted,
            first_token,
            None if state.first_token else error,
            **attributes,
            **{
                "radixserve.prompt_tokens": len(req.origin_input_ids),
                "radixserve.cached_tokens": req.cached_tokens or 0,  # set at admission
            },
        )
        if state.first_token is not None:
            tracing.record(
                "decode",
                carrier,
                first_token,
                now,
                error,
                **attributes,
                **{
                    "radixserve.completion_tokens": len(req.output_ids),
                    "radixserve.retractions": req.num_retractions,
                },
            )

    # ----- control ----------------------------------------------------------------------

    def send_ready(self) -> None:
        """Send WorkerReady once the tokenizer's socket is connected (until then a send is
        refused, and the next loop turn tries again)."""
        if not self.to_tokenizer.sock.poll(0, zmq.POLLOUT):
            return
        sched = self.scheduler
        ready = WorkerReady(
            model_path=self.settings.model,
            served_model_name=self.model_name,
            max_total_tokens=sched.max_total_tokens,
            context_length=sched.context_len,
            vocab_size=sched.model_config.vocab_size,
            eos_token_ids=sorted(sched.model_config.eos_token_ids),
            max_running_requests=sched.max_running_requests,
            lora_adapters=sched.lora.adapters(),
        )
        if self.to_tokenizer.send(ready):
            self.ready_pending = False
            logger.info("sent WorkerReady to the tokenizer")

    def flush_cache(self, rid: str) -> FlushCacheReqOutput:
        """Empty the prefix cache and both pools; refused while any request holds KV or waits
        for it (SGLang answers such a flush with 409)."""
        sched = self.scheduler
        if sched.has_work():
            now = sched.snapshot(adapters=False)
            message = (
                f"cannot flush the cache while requests are in flight "
                f"({now.running} running, {now.waiting} waiting)"
            )
            logger.info("refused flush_cache: %s", message)
            return FlushCacheReqOutput(success=False, message=message, rid=rid)
        sched.flush_cache()
        self.publish_kv_events()
        logger.info("flushed the cache")
        return FlushCacheReqOutput(success=True, message="cache flushed", rid=rid)

    def update_lora(self, msg: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> LoRAAdapterReqOutput:
        """Load or unload an adapter between turns; a refusal (bad adapter, requests using
        it) leaves everything serving as it was."""
        sched = self.scheduler
        try:
            if isinstance(msg, LoadLoRAAdapterReq):
                sched.load_lora_adapter(msg.name, msg.path)
                message = f"loaded LoRA adapter {msg.name!r} from {msg.path!r}"
            else:
                sched.unload_lora_adapter(msg.name)
                message = f"unloaded LoRA adapter {msg.name!r}"
        except LoRAError as e:
            logger.info("refused a LoRA update of %r: %s", msg.name, e)
            return LoRAAdapterReqOutput(
                success=False,
                status=e.status,
                message=str(e),
                param=e.param,
                lora_adapters=sched.lora.adapters(),
                rid=msg.rid,
            )
        logger.info(message)
        self.metrics.publish(self.sample())
        return LoRAAdapterReqOutput(
            success=True, message=message, lora_adapters=sched.lora.adapters(), rid=msg.rid
        )

    def server_info(self) -> dict[str, Any]:
        sched, now = self.scheduler, self.scheduler.snapshot()
        return {
            "model_path": self.settings.model,
            "served_model_name": self.model_name,
            "max_total_tokens": sched.max_total_tokens,
            "context_length": sched.context_len,
            "max_running_requests": sched.max_running_requests,
            "chunked_prefill_size": sched.chunked_prefill_size,
            "tp_size": sched.tp_group.size,
            "available_kv_tokens": now.free_kv,
            "evictable_kv_tokens": now.evictable_kv,
            "protected_kv_tokens": now.protected_kv,
            "num_running_reqs": now.running,
            "num_waiting_reqs": now.waiting,
            "new_token_ratio": now.new_token_ratio,
            "scheduler_stats": now.counters,
            "lora_adapters": sched.lora.adapters(),
            "cpu_isa": self.cpu_info.isa,
            "enable_deterministic_inference": self.core.model_runner.deterministic,
            "speculative_algorithm": self.settings.speculative_algorithm,
            "speculative_num_draft_tokens": self.settings.speculative_num_draft_tokens,
            "cpu_flags": [] if self.cpu_isa is None else list(self.cpu_isa.flags),
            # The port it bound: the one given, or the free one it chose.
            "worker_metrics_port": (
                None if self.metrics_server is None else self.metrics_server.port
            ),
        }

    def check_integrity(self) -> str:
        """The KV integrity check (every KV slot accounted for exactly once, the tree's size
        ledgers and evictable set right): "ok", what is wrong, or "skipped" while requests
        hold KV (their slots are mid-flight under the overlap loop)."""
        sched = self.scheduler
        if sched.has_work():
            now = sched.snapshot(adapters=False)
            return f"skipped: {now.running} running and {now.waiting} waiting request(s)"
        try:
            sched.cache_manager.check_integrity()
        except AssertionError as e:
            logger.error("radix tree integrity check failed: %s", e)
            return f"failed: {e}"
        return "ok"

    def sample(self) -> WorkerSample:
        """The scheduler's counters and sizes now, for the metrics (taken between turns)."""
        now = self.scheduler.snapshot()
        stats = now.counters
        return WorkerSample(
            time=time.monotonic(),
            cache_hit_tokens=stats["cache_hit_tokens"],
            cache_query_tokens=stats["cache_query_tokens"],
            prompt_tokens=stats["prefill_tokens"],
            generation_tokens=stats["generation_tokens"],
            retracted_requests=stats["num_retractions"],
            retracted_input_tokens=stats["retracted_input_tokens"],
            retracted_output_tokens=stats["retracted_output_tokens"],
            evicted_tokens=now.evicted_kv,
            new_token_ratio=now.new_token_ratio,
            evictable_tokens=now.evictable_kv,
            protected_tokens=now.protected_kv,
            available_tokens=now.free_kv,
            total_tokens=self.scheduler.max_total_tokens,
            num_running=now.running,
            num_waiting=now.waiting,
            num_grammar_queue=now.compiling,
            kv_events_published=self.kv_publisher.published if self.kv_publisher else 0,
            kv_events_dropped=self.kv_publisher.dropped if self.kv_publisher else 0,
            spec_verify_steps=stats["spec_verify_steps"],
            spec_proposed_tokens=stats["spec_proposed_tokens"],
            spec_accepted_tokens=stats["spec_accepted_tokens"],
            spec_accept_lengths=tuple(sorted(stats["spec_accept_lengths"].items())),
            running_lora_adapters=now.running_lora_adapters,
            waiting_lora_adapters=now.waiting_lora_adapters,
        )


class _PromptLogprobColumns(NamedTuple):
    """The `input_*` columns of one BatchTokenIDOutput."""

    input_token_logprobs_val: list[list[float | None]] | None = None
    input_top_logprobs_val: list[list[list[float]]] | None = None
    input_top_logprobs_idx: list[list[list[int]]] | None = None


def _prompt_logprob_columns(entries: list[_Entry]) -> _PromptLogprobColumns:
    """The `input_*` columns of an output batch: each entry's prompt logprobs when it
    carries them, else []; None when no entry carries any."""
    carrying = [e.req if e.prompt_logprobs else None for e in entries]
    if not any(carrying):
        return _PromptLogprobColumns()
    values = [req.input_token_logprobs if req else [] for req in carrying]
    if not any(req and req.sampling_params.prompt_top_logprobs_num for req in carrying):
        return _PromptLogprobColumns(values)
    tops = [req.input_top_logprobs if req else [] for req in carrying]
    return _PromptLogprobColumns(
        values,
        [[[lp for lp, _ in t] for t in top] for top in tops],
        [[[tid for _, tid in t] for t in top] for top in tops],
    )


def _detokenizer_state(req: Req) -> DetokenizerReqState:
    params = req.sampling_params
    return DetokenizerReqState(req.rid, params.stop, params.skip_special_tokens)
