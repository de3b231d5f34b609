"""The worker's metrics: the scheduler's events heard as its observer (histograms, the
loop's progress), the samples of its counters the loop publishes for scrapes, and the
CPU facts the worker reports once at start (`radixserve_cpu_info`)."""

from __future__ import annotations

import time

from engine.kernels.cpu.isa import CpuIsa, cpu_isa
from engine.sched.req import Req
from engine.sched.scheduler import Scheduler
from engine.sched.stats import PoolSizes, SchedulerInfo
from observability.worker_metrics import CpuInfo, SWASample, WorkerMetrics, WorkerSample
from services.process import Service
from services.worker.kv_event_publisher import ZmqEventPublisher
from services.worker.outputs import ReqState

METRICS_SAMPLE_INTERVAL_S = 0.25
"""How often the loop copies the scheduler's counters for scrapes: fresh, and cheap."""


def cpu_facts(info: SchedulerInfo) -> tuple[CpuIsa | None, CpuInfo]:
    """The CPU's instruction sets and kernel path (None on an accelerator), and the facts
    `radixserve_cpu_info` carries: on CUDA the path is "cuda"."""
    isa = cpu_isa() if info.device_type == "cpu" else None
    return isa, CpuInfo(
        isa=info.device_type if isa is None else isa.path,
        dtype=info.dtype,
        weights=info.weights_format,
        kv_cache_dtype=info.kv_cache_dtype,
        deterministic=str(info.deterministic).lower(),
    )


def swa_sample(sizes: PoolSizes | None, total: int | None) -> SWASample | None:
    """A hybrid model's sliding-window pool for the metrics (None: one pool)."""
    if sizes is None or total is None:
        return None
    return SWASample(total, sizes.free, sizes.evictable, sizes.protected)


class WorkerMetricsMixin(Service):
    """The `Worker`'s metrics side (a base of it, as SGLang's scheduler mixins are); it is
    the scheduler's `SchedulerObserver`."""

    scheduler: Scheduler
    info: SchedulerInfo
    metrics: WorkerMetrics
    live: dict[str, ReqState]
    kv_publisher: ZmqEventPublisher | None

    def on_admit(self, req: Req) -> None:
        state = self.live.get(req.rid)
        if state is not None:
            state.admitted = time.monotonic()
            self.metrics.queue_time.observe(state.admitted - state.arrived)

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        self.metrics.observe_forward(mode, batch_size, seconds)

    def on_progress(self) -> None:
        self.mark_progress()

    def on_grammar_compile(self, library: str, seconds: float) -> None:
        self.metrics.observe_grammar_compile(library, seconds)

    def on_grammar_cache_hit(self, library: str) -> None:
        self.metrics.count_grammar_cache_hit(library)

    def on_grammar_refused(self, library: str, reason: str) -> None:
        self.metrics.count_grammar_refusal(library, reason)

    def on_grammar_mask(self, library: str, seconds: float) -> None:
        self.metrics.observe_grammar_mask(library, seconds)

    def sample(self) -> WorkerSample:
        """The scheduler's counters and sizes now, for the metrics (taken between turns)."""
        now = self.scheduler.snapshot()
        stats = now.counters
        return WorkerSample(
            time=time.monotonic(),
            cache_hit_tokens=stats["cache_hit_tokens"],
            cache_full_hit_tokens=stats["cache_full_hit_tokens"],
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
            total_tokens=self.info.max_total_tokens,
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
            swa=swa_sample(now.swa_kv, self.info.swa_max_total_tokens),
        )
