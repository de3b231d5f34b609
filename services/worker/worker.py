"""The worker: the engine's scheduler behind a ZMQ loop.

The worker's loop is the scheduler's event loop (normal or overlap): it polls the sockets
at the start of each turn and sends the turn's outputs at its end. Requests arrive from
the tokenizer already tokenized; each turn's new tokens go to the detokenizer as one
`BatchTokenIDOutput` (outputs.py), and control replies (ready, flush, server info, LoRA
updates) go straight back to the tokenizer on the control socket (control.py). Once the
model is loaded the worker serves `/metrics` and `/healthz` on its metrics port
(metrics.py), and a traced request gets its queue-wait, prefill and decode spans when it
finishes. It reads the scheduler through the scheduler's own methods only
(`engine/sched/status.py`).

On a CPU device the worker says once at start which instruction sets the CPU has and which
kernel path runs (`cpu_isa`), with the dtype and the weights' format; the same shows as
`radixserve_cpu_info` and in `/get_server_info` (`cpu_isa`, `cpu_flags`). On CUDA the path is
reported as "cuda" and no CPU flags: the CPU's instruction sets do not run the model there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.build import build
from engine.lora import LoRAError
from engine.sched.req import FinishReason, Req
from observability.worker_metrics import WorkerMetrics
from services.io_struct import (
    FRAME_HEADROOM_BYTES,
    AbortReq,
    FlushCacheReq,
    GetServerInfoReq,
    LoadLoRAAdapterReq,
    Message,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
)
from services.ipc import MAX_MESSAGE_BYTES, PeerEvent
from services.settings import Settings
from services.worker.control import WorkerControlMixin
from services.worker.kv_event_publisher import start_kv_events
from services.worker.metrics import METRICS_SAMPLE_INTERVAL_S, cpu_facts
from services.worker.outputs import ReqState

logger = logging.getLogger(__name__)


class Worker(WorkerControlMixin):
    """The loop; its outputs, control requests and metrics are its bases' jobs."""

    role = "worker"

    def __init__(self, settings: Settings):
        # Load before binding: until the model is in memory there is nobody to send
        # heartbeats, and a tokenizer pushing requests meanwhile gets a clear refusal
        # (IMMEDIATE) instead of a queue that nobody drains.
        started = time.monotonic()
        self.core = build(settings.to_engine_args())
        self.scheduler = self.core.scheduler
        self.info = info = self.scheduler.info()
        logger.info(
            "engine ready in %.1f s: %s, max_total_tokens=%d context_length=%d "
            "max_running_requests=%d device=%s tp_size=%d",
            time.monotonic() - started,
            settings.model,
            info.max_total_tokens,
            info.context_len,
            info.max_running_requests,
            info.device,
            settings.tp_size,
        )
        self.cpu_isa, self.cpu_info = cpu_facts(info)
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
        self.to_tokenizer = self.connect(settings.zmq_address("tokenizer_control_port"))
        self.live: dict[str, ReqState] = {}
        self.rejected: list[Req] = []
        self.ready_pending = True
        self.model_name = settings.model_id
        self.speculative = settings.speculative_algorithm is not None
        max_lora = settings.max_loras_per_batch if settings.enable_lora else 0
        self.metrics = WorkerMetrics(self.registry, self.model_name, max_lora, self.cpu_info)
        self.scheduler.observe(self)
        self.kv_events, self.kv_publisher = start_kv_events(
            settings.kv_events(), settings.kv_events_block_size, self.scheduler
        )
        self.metrics.publish(self.sample())
        self.next_sample = 0.0
        # Only now: a startupProbe on /healthz must not pass before the model is loaded.
        self.serve_metrics(settings.worker_metrics_port)

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """The scheduler's event loop, polling the sockets once a turn."""
        self.scheduler.run_event_loop(should_stop, self.poll, self.send_outputs)

    def has_work(self) -> bool:
        """The scheduler has work, or outputs wait to be sent: the poll then waits for none."""
        return bool(
            self.scheduler.has_work() or self.scheduler.has_pending_outputs() or self.rejected
        )

    def poll(self) -> None:
        if self.ready_pending:
            self.send_ready()
        super().poll()
        if self.last_turn >= self.next_sample:
            self.metrics.publish(self.sample())
            self.next_sample = self.last_turn + METRICS_SAMPLE_INTERVAL_S

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
            self.to_tokenizer.send(self.get_server_info(msg))
        elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
            self.to_tokenizer.send(self.update_lora(msg))
        else:
            logger.warning(
                "dropped a %s from %s: not a worker message", type(msg).__name__, msg.sender or "?"
            )

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        req = Req.of(msg)
        state = ReqState(msg.epoch, trace_context=msg.trace_context)
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
