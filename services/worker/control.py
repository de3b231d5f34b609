"""The worker's control requests, answered on the control socket to the tokenizer:
WorkerReady (the limits the tokenizer checks requests against), cache flushes, run-time
LoRA updates, and /get_server_info (with the KV integrity check on request)."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from engine.kernels.cpu.isa import CpuIsa
from engine.lora import LoRAError
from engine.sched.scheduler import Scheduler
from engine.sched.stats import PoolSizes, SchedulerInfo
from observability.worker_metrics import CpuInfo
from services.io_struct import (
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    UnloadLoRAAdapterReq,
    WorkerReady,
)
from services.ipc import Sender
from services.worker.metrics import WorkerMetricsMixin
from services.worker.outputs import WorkerOutputMixin

logger = logging.getLogger(__name__)


class WorkerControlMixin(WorkerOutputMixin, WorkerMetricsMixin):
    """The `Worker`'s control side (a base of it, as SGLang's scheduler mixins are)."""

    scheduler: Scheduler
    info: SchedulerInfo
    to_tokenizer: Sender
    ready_pending: bool
    """WorkerReady is owed to the tokenizer: not yet delivered, or the tokenizer restarted."""
    model_name: str
    cpu_isa: CpuIsa | None
    cpu_info: CpuInfo

    def send_ready(self) -> None:
        """Send WorkerReady once the tokenizer's socket is connected (until then a send is
        refused, and the next loop turn tries again)."""
        if not self.to_tokenizer.sock.poll(0, zmq.POLLOUT):
            return
        info = self.info
        ready = WorkerReady(
            model_path=self.settings.model,
            served_model_name=self.model_name,
            max_total_tokens=info.max_total_tokens,
            context_length=info.context_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            max_running_requests=info.max_running_requests,
            lora_adapters=self.scheduler.lora_adapters(),
        )
        if self.to_tokenizer.send(ready):
            self.ready_pending = False
            logger.info("sent WorkerReady to the tokenizer")

    def flush_cache(self, rid: str) -> FlushCacheReqOutput:
        """Empty the prefix cache and both pools; refused while any request holds KV or waits
        for it (SGLang answers such a flush with 409)."""
        if self.scheduler.has_work():
            now = self.scheduler.snapshot(adapters=False)
            message = (
                f"cannot flush the cache while requests are in flight "
                f"({now.running} running, {now.waiting} waiting)"
            )
            logger.info("refused flush_cache: %s", message)
            return FlushCacheReqOutput(success=False, message=message, rid=rid)
        self.scheduler.flush_cache()
        self.publish_kv_events()
        logger.info("flushed the cache")
        return FlushCacheReqOutput(success=True, message="cache flushed", rid=rid)

    def update_lora(self, msg: LoadLoRAAdapterReq | UnloadLoRAAdapterReq) -> LoRAAdapterReqOutput:
        """Load or unload an adapter between turns; a refusal (bad adapter, requests using
        it) leaves everything serving as it was."""
        try:
            if isinstance(msg, LoadLoRAAdapterReq):
                self.scheduler.load_lora_adapter(msg.name, msg.path)
                message = f"loaded LoRA adapter {msg.name!r} from {msg.path!r}"
            else:
                self.scheduler.unload_lora_adapter(msg.name)
                message = f"unloaded LoRA adapter {msg.name!r}"
        except LoRAError as e:
            logger.info("refused a LoRA update of %r: %s", msg.name, e)
            return LoRAAdapterReqOutput(
                success=False,
                status=e.status,
                message=str(e),
                param=e.param,
                lora_adapters=self.scheduler.lora_adapters(),
                rid=msg.rid,
            )
        logger.info(message)
        self.metrics.publish(self.sample())
        return LoRAAdapterReqOutput(
            success=True,
            message=message,
            lora_adapters=self.scheduler.lora_adapters(),
            rid=msg.rid,
        )

    def get_server_info(self, msg: GetServerInfoReq) -> GetServerInfoReqOutput:
        info = self.server_info()
        if msg.check_integrity:
            info["radix_integrity"] = self.check_integrity()
        return GetServerInfoReqOutput(info=info, rid=msg.rid)

    def server_info(self) -> dict[str, Any]:
        info, now = self.info, self.scheduler.snapshot()
        return {
            "model_path": self.settings.model,
            "served_model_name": self.model_name,
            "max_total_tokens": info.max_total_tokens,
            "swa_max_total_tokens": info.swa_max_total_tokens,
            "context_length": info.context_len,
            "max_running_requests": info.max_running_requests,
            "chunked_prefill_size": info.chunked_prefill_size,
            "tp_size": info.tp_size,
            "available_kv_tokens": now.free_kv,
            "evictable_kv_tokens": now.evictable_kv,
            "protected_kv_tokens": now.protected_kv,
            **swa_kv_info(now.swa_kv),
            "num_running_reqs": now.running,
            "num_waiting_reqs": now.waiting,
            "new_token_ratio": now.new_token_ratio,
            "scheduler_stats": now.counters,
            "lora_adapters": self.scheduler.lora_adapters(),
            "cpu_isa": self.cpu_info.isa,
            "enable_deterministic_inference": info.deterministic,
            "grammar_backend": self.settings.grammar_backend,
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
        if self.scheduler.has_work():
            now = self.scheduler.snapshot(adapters=False)
            return f"skipped: {now.running} running and {now.waiting} waiting request(s)"
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            logger.error("radix tree integrity check failed: %s", e)
            return f"failed: {e}"
        return "ok"


def swa_kv_info(sizes: PoolSizes | None) -> dict[str, int | None]:
    """A hybrid model's sliding-window pool beside `available_kv_tokens` and the tree's two
    (then the full-attention pool's); None with one pool."""
    free, evictable, protected = (None, None, None) if sizes is None else sizes
    return {
        "swa_available_kv_tokens": free,
        "swa_evictable_kv_tokens": evictable,
        "swa_protected_kv_tokens": protected,
    }
