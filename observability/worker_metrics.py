"""The worker's Prometheus metrics (the list is in docs/operations.md).

The scheduler keeps plain counters and sizes; the worker copies them into a
`WorkerSample` on its event loop, between steps, a few times a second. A scrape only reads
the latest sample, so it never sees a half-done step and costs the loop nothing. Per-event
values (queue time, batch size, forward time, grammar compiles) are histograms the worker
observes as the events happen.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

ROLLING_WINDOW_S = 60.0
"""How far back the rolling hit-rate and throughput gauges look."""
ROLLING_POINT_S = 1.0
"""Spacing of the samples kept for them."""

QUEUE_TIME_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FORWARD_TIME_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)
"""Fine below 50 ms, where a decode step lies on a CPU (docs/benchmarks/model.md) and on a
GPU (docs/benchmarks/serving-gpu.md): the serving benchmark reads ITL minus the forward p50
from this histogram, which coarser buckets could not resolve (docs/benchmarks/serving.md)."""
COMPILE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30)
GRAMMAR_LIBRARIES = ("xgrammar", "llguidance")
GRAMMAR_REFUSAL_REASONS = ("limits", "invalid", "compile_budget", "mask_budget")
MASK_TIME_BUCKETS = (
    0.00001,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.1,
)
SPEC_ACCEPT_LENGTH_BUCKETS = tuple(range(1, 17))
"""Tokens a request takes from one speculative verify pass (1 + drafts accepted): one
bucket per length up to 16; longer passes (more draft tokens) land in +Inf only."""

# Label values of a layout with one rank and token-granular KV slots; dashboards read the
# labels, so they stay.
TP_RANK = "0"
PAGE_SIZE = 1


def held_share(total: int, available: int, evictable: int) -> float:
    """Share of a pool held by live requests: what the tree could give back is free."""
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, (total - available - evictable) / total))


class SWASample(NamedTuple):
    """A hybrid model's sliding-window KV pool at the moment of a `WorkerSample`."""

    total_tokens: int
    available_tokens: int
    evictable_tokens: int
    protected_tokens: int

    @property
    def usage(self) -> float:
        return held_share(self.total_tokens, self.available_tokens, self.evictable_tokens)


@dataclass(frozen=True)
class WorkerSample:
    """The worker's counters and sizes at one moment, in plain numbers."""

    time: float
    """time.monotonic() when it was taken."""
    cache_hit_tokens: int
    cache_query_tokens: int
    prompt_tokens: int
    """Tokens computed by prefill (radix hits excluded)."""
    generation_tokens: int
    retracted_requests: int
    retracted_input_tokens: int
    retracted_output_tokens: int
    evicted_tokens: int
    new_token_ratio: float
    evictable_tokens: int
    protected_tokens: int
    available_tokens: int
    total_tokens: int
    num_running: int
    num_waiting: int
    num_grammar_queue: int
    kv_events_published: int = 0
    kv_events_dropped: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    """Adapters of the running batch's requests, sorted."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Adapters of waiting requests, sorted."""
    spec_verify_steps: int = 0
    """Request-steps of speculative verify passes (each request in each pass)."""
    spec_proposed_tokens: int = 0
    """Drafted tokens verified."""
    spec_accepted_tokens: int = 0
    """Drafted tokens accepted."""
    spec_accept_lengths: tuple[tuple[int, int], ...] = ()
    """(tokens a request took from one verify pass, how many times), by length."""
    swa: SWASample | None = None
    """A hybrid model's sliding-window pool (None: one pool); the sizes above are then the
    full-attention pool's."""
    cache_full_hit_tokens: int = 0
    """Of `cache_query_tokens`, those whose full-attention KV the tree held: a hybrid
    model's hit (`cache_hit_tokens`) stops short of them where its window's SWA KV went."""

    @property
    def kv_usage(self) -> float:
        return held_share(self.total_tokens, self.available_tokens, self.evictable_tokens)


class CpuInfo(NamedTuple):
    """What runs the model: the `radixserve_cpu_info` gauge's labels."""

    isa: str
    """The CPU kernel path (`cpu_isa`: none, avx2, avx512, amx), or the accelerator ("cuda")."""
    dtype: str
    weights: str
    """How the weights are held: the dtype's name or the quantized format (`gguf:Q4_1`)."""
    kv_cache_dtype: str
    """What the KV cache holds (`--kv-cache-dtype`)."""
    deterministic: str
    """"true" under --enable-deterministic-inference (the batch-invariant kernels), else "false"."""


class _Rolling:
    """Hit rate and generation throughput over the last ROLLING_WINDOW_S of samples."""

    def __init__(self) -> None:
        self.points: deque[WorkerSample] = deque()
        self.hit_rate = 0.0

    def add(self, sample: WorkerSample) -> None:
        if self.points and sample.time - self.points[-1].time < ROLLING_POINT_S:
            self.points[-1] = sample  # keep the newest; the spacing bounds the deque
        else:
            self.points.append(sample)
        while len(self.points) > 2 and sample.time - self.points[1].time >= ROLLING_WINDOW_S:
            self.points.popleft()
        oldest = self.points[0]
        queries = sample.cache_query_tokens - oldest.cache_query_tokens
        if len(self.points) == 1 and sample.cache_query_tokens:
            self.hit_rate = sample.cache_hit_tokens / sample.cache_query_tokens
        elif queries > 0:  # no admission in the window: the last known rate stands
            self.hit_rate = (sample.cache_hit_tokens - oldest.cache_hit_tokens) / queries

    def throughput(self) -> float:
        if not self.points:
            return 0.0
        oldest, newest = self.points[0], self.points[-1]
        elapsed = newest.time - oldest.time
        return (
            (newest.generation_tokens - oldest.generation_tokens) / elapsed if elapsed > 0 else 0.0
        )


class WorkerMetrics(Collector):
    """Every worker metric, on `registry`, labelled `model_name` and `tp_rank`.
    `max_lora` > 0 (LoRA serving on) adds the adapter metrics; `cpu_info`, the info gauge of
    what runs the model."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_lora: int = 0,
        cpu_info: CpuInfo | None = None,
    ):
        self.labels = {"model_name": model_name, "tp_rank": TP_RANK}
        self.lock = threading.Lock()
        self.latest: WorkerSample | None = None
        self.rolling = _Rolling()
        self.max_lora = max_lora
        self.cpu_info = cpu_info
        self.lora_updated = time.time()
        """Unix time the running or waiting adapter set last changed (the info gauge's value)."""
        names, values = list(self.labels), list(self.labels.values())
        self.queue_time = Histogram(
            "radixserve_queue_time_seconds",
            "Seconds from arrival at the worker to first admission into a batch",
            names,
            registry=registry,
            buckets=QUEUE_TIME_BUCKETS,
        ).labels(*values)
        self.batch_size = Histogram(
            "radixserve_batch_size",
            "Requests per forward batch, by forward mode",
            [*names, "mode"],
            registry=registry,
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.forward_time = Histogram(
            "radixserve_forward_time_seconds",
            "Seconds per forward pass and sampling, by forward mode",
            [*names, "mode"],
            registry=registry,
            buckets=FORWARD_TIME_BUCKETS,
        )
        self.grammar_compile_time = Histogram(
            "radixserve_grammar_compile_time_seconds",
            "Seconds to compile a grammar (cache hits excluded), by library",
            [*names, "backend"],
            registry=registry,
            buckets=COMPILE_TIME_BUCKETS,
        )
        self.grammar_mask_time = Histogram(
            "radixserve_grammar_mask_time_seconds",
            "Seconds to fill one request's token mask for one step, by library",
            [*names, "backend"],
            registry=registry,
            buckets=MASK_TIME_BUCKETS,
        )
        self.grammar_cache_hits = Counter(
            "radixserve_grammar_cache_hits",
            "Grammar requests served by a compile already made or under way, by library",
            [*names, "backend"],
            registry=registry,
        )
        self.grammar_refusals = Counter(
            "radixserve_grammar_refusals",
            "Grammar requests failed in the worker, by library and reason: limits, invalid, "
            "compile_budget (a compile killed at its time or memory budget, or left waiting "
            "past it), mask_budget (a step's mask past --grammar-mask-timeout-ms, or over "
            "llguidance's per-token budget)",
            [*names, "backend", "reason"],
            registry=registry,
        )
        for library in GRAMMAR_LIBRARIES:  # zeros from the start, so rate() has series
            self.grammar_cache_hits.labels(*values, library)
            for reason in GRAMMAR_REFUSAL_REASONS:
                self.grammar_refusals.labels(*values, library, reason)
        self.lora_requests = Counter(
            "radixserve_lora_requests",
            "Requests submitted with a LoRA adapter, by adapter",
            [*names, "lora_name"],
            registry=registry,
        )
        registry.register(self)

    # ----- what the worker calls --------------------------------------------------------

    def publish(self, sample: WorkerSample) -> None:
        with self.lock:
            if self.latest is None or _lora_sets(self.latest) != _lora_sets(sample):
                self.lora_updated = time.time()
            self.latest = sample
            self.rolling.add(sample)

    def observe_lora_request(self, lora_name: str) -> None:
        self.lora_requests.labels(*self.labels.values(), lora_name).inc()

    def observe_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        values = (*self.labels.values(), mode)
        self.batch_size.labels(*values).observe(batch_size)
        self.forward_time.labels(*values).observe(seconds)

    def observe_grammar_compile(self, library: str, seconds: float) -> None:
        self.grammar_compile_time.labels(*self.labels.values(), library).observe(seconds)

    def observe_grammar_mask(self, library: str, seconds: float) -> None:
        self.grammar_mask_time.labels(*self.labels.values(), library).observe(seconds)

    def count_grammar_cache_hit(self, library: str) -> None:
        self.grammar_cache_hits.labels(*self.labels.values(), library).inc()

    def count_grammar_refusal(self, library: str, reason: str) -> None:
        self.grammar_refusals.labels(*self.labels.values(), library, reason).inc()

    # ----- the scrape -------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the sample; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            s, hit_rate, throughput = self.latest, self.rolling.hit_rate, self.rolling.throughput()
            lora_updated = self.lora_updated
        if self.cpu_info is not None:
            yield self._cpu_info(self.cpu_info)
        if s is None:
            return
        if self.max_lora > 0:
            yield self._lora_info(s, lora_updated)
        for name, doc, value in _counters(s):
            yield self._family(CounterMetricFamily, name, doc, value)
        for name, doc, value in _gauges(s, hit_rate, throughput):
            yield self._family(GaugeMetricFamily, name, doc, value)
        if s.swa is not None:
            for name, doc, value in _swa_gauges(s.swa):
                yield self._family(GaugeMetricFamily, name, doc, value)
            yield self._pool_hits(s)
        yield self._histogram(
            "radixserve_spec_accept_length",
            "Tokens a request took from one speculative verify pass (1 + drafts accepted)",
            SPEC_ACCEPT_LENGTH_BUCKETS,
            s.spec_accept_lengths,
        )
        yield self._cache_config_info(s)

    def _pool_hits(self, s: WorkerSample) -> Metric:
        """A hybrid model's prefix-cache hits per pool: the full-attention KV the tree held,
        and what the window rule left of it to reuse (the hit itself)."""
        hits = CounterMetricFamily(
            "radixserve_swa_prefix_cache_hit_tokens",
            "Hybrid models: prompt tokens of first admissions whose KV the radix tree held, "
            'per pool: "full", the full-attention KV; "swa", what was reused once the window '
            "before the hit's end had to be live (radixserve_prefix_cache_hit_tokens)",
            labels=[*self.labels, "pool"],
        )
        hits.add_metric([*self.labels.values(), "full"], s.cache_full_hit_tokens)
        hits.add_metric([*self.labels.values(), "swa"], s.cache_hit_tokens)
        return hits

    def _cache_config_info(self, s: WorkerSample) -> Metric:
        info = GaugeMetricFamily(
            "radixserve_cache_config_info",
            "KV cache layout (value 1)",
            labels=[*self.labels, "page_size", "num_pages"],
        )
        info.add_metric(
            [*self.labels.values(), str(PAGE_SIZE), str(s.total_tokens // PAGE_SIZE)], 1
        )
        return info

    def _cpu_info(self, cpu: CpuInfo) -> Metric:
        info = GaugeMetricFamily(
            "radixserve_cpu_info",
            "What runs the model (value 1): the CPU kernel path (or the accelerator), the "
            "dtype, the weights' format and the KV cache's dtype",
            labels=[*self.labels, *CpuInfo._fields],
        )
        info.add_metric([*self.labels.values(), *cpu], 1)
        return info

    def _lora_info(self, s: WorkerSample, updated: float) -> Metric:
        """The Gateway API Inference Extension's adapter gauge (vLLM's layout): the adapter
        sets as comma-joined labels, the value the time they last changed."""
        info = GaugeMetricFamily(
            "radixserve_lora_requests_info",
            "LoRA adapters of running and waiting requests (value: unix time of the last change)",
            labels=[*self.labels, "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        info.add_metric(
            [
                *self.labels.values(),
                ",".join(s.running_lora_adapters),
                ",".join(s.waiting_lora_adapters),
                str(self.max_lora),
            ],
            updated,
        )
        return info

    def _family(self, cls: type, name: str, doc: str, value: float) -> Metric:
        family = cls(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _histogram(
        self, name: str, doc: str, bounds: tuple[int, ...], counts: tuple[tuple[int, int], ...]
    ) -> Metric:
        """A histogram of integer observations kept as (value, times seen) pairs: cumulative
        buckets at `bounds`, then +Inf, with their sum and count. No pairs (also a falsy
        placeholder, as in a sample built as all zeros) is an empty histogram."""
        counts = counts or ()
        buckets = [(str(bound), float(sum(n for v, n in counts if v <= bound))) for bound in bounds]
        total = float(sum(n for _, n in counts))
        family = HistogramMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(
            list(self.labels.values()),
            [*buckets, ("+Inf", total)],
            sum_value=float(sum(v * n for v, n in counts)),
        )
        return family


def _lora_sets(s: WorkerSample) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return s.running_lora_adapters, s.waiting_lora_adapters


Series = tuple[tuple[str, str, float], ...]
"""(name, help, value) of each metric of one kind."""


def _counters(s: WorkerSample) -> Series:
    """The counters of a sample, as the scheduler counts them."""
    return (
        (
            "radixserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the radix tree, once per request at first admission",
            s.cache_hit_tokens,
        ),
        (
            "radixserve_prefix_cache_query_tokens",
            "Prompt tokens of those same first admissions",
            s.cache_query_tokens,
        ),
        (
            "radixserve_prompt_tokens",
            "Prompt tokens computed by prefill (radix hits excluded; a retracted "
            "request's re-prefill counts again)",
            s.prompt_tokens,
        ),
        ("radixserve_generation_tokens", "Tokens generated", s.generation_tokens),
        (
            "radixserve_retracted_requests",
            "Running requests sent back to the queue for lack of KV slots",
            s.retracted_requests,
        ),
        (
            "radixserve_retracted_input_tokens",
            "Prompt tokens of retracted requests",
            s.retracted_input_tokens,
        ),
        (
            "radixserve_retracted_output_tokens",
            "Generated tokens of retracted requests, to be recomputed",
            s.retracted_output_tokens,
        ),
        (
            "radixserve_radix_evicted_tokens",
            "Tokens evicted from the radix tree",
            s.evicted_tokens,
        ),
        (
            "radixserve_kv_events_published_batches",
            "KV-cache event batches sent to subscribers (--kv-events-config)",
            s.kv_events_published,
        ),
        (
            "radixserve_kv_events_dropped_batches",
            "KV-cache event batches dropped because the publisher queue was full",
            s.kv_events_dropped,
        ),
        (
            "radixserve_spec_verify_steps",
            "Request-steps of speculative verify passes (each request in each pass)",
            s.spec_verify_steps,
        ),
        (
            "radixserve_spec_proposed_tokens",
            "Drafted tokens verified by speculative decoding",
            s.spec_proposed_tokens,
        ),
        (
            "radixserve_spec_accepted_tokens",
            "Drafted tokens the verify passes accepted",
            s.spec_accepted_tokens,
        ),
    )


def _gauges(s: WorkerSample, hit_rate: float, throughput: float) -> Series:
    """The gauges of a sample, with the rolling window's hit rate and throughput."""
    return (
        (
            "radixserve_cache_hit_rate",
            f"Prefix-cache hit tokens / query tokens over the last "
            f"{ROLLING_WINDOW_S:g} s (dashboards use the counters)",
            hit_rate,
        ),
        (
            "radixserve_generation_tokens_per_second",
            f"Generated tokens per second over the last {ROLLING_WINDOW_S:g} s",
            throughput,
        ),
        (
            "radixserve_new_token_ratio",
            "Current overcommit ratio applied to running requests' reservations",
            s.new_token_ratio,
        ),
        (
            "radixserve_radix_evictable_tokens",
            "Tokens in the radix tree that no request holds",
            s.evictable_tokens,
        ),
        (
            "radixserve_radix_protected_tokens",
            "Tokens in the radix tree locked by running requests",
            s.protected_tokens,
        ),
        (
            "radixserve_kv_usage_ratio",
            "(total - available - evictable) / total: KV held by live requests",
            s.kv_usage,
        ),
        ("radixserve_kv_total_tokens", "KV pool size in tokens", s.total_tokens),
        ("radixserve_num_requests_running", "Requests in the running batch", s.num_running),
        ("radixserve_num_requests_waiting", "Requests waiting for admission", s.num_waiting),
        (
            "radixserve_num_requests_grammar_queue",
            "Requests waiting for their grammar to compile",
            s.num_grammar_queue,
        ),
    )


def _swa_gauges(swa: SWASample) -> Series:
    """A hybrid model's sliding-window pool, beside the full pool's gauges."""
    return (
        (
            "radixserve_swa_kv_usage_ratio",
            "(total - available - evictable) / total of the sliding-window KV pool: its share "
            "held by live requests (SGLang's swa_token_usage)",
            swa.usage,
        ),
        (
            "radixserve_swa_kv_total_tokens",
            "Sliding-window KV pool size in tokens",
            swa.total_tokens,
        ),
        (
            "radixserve_radix_swa_evictable_tokens",
            "Tokens whose sliding-window KV the radix tree holds and no request locks",
            swa.evictable_tokens,
        ),
        (
            "radixserve_radix_swa_protected_tokens",
            "Tokens whose sliding-window KV the radix tree holds locked by running requests",
            swa.protected_tokens,
        ),
    )
