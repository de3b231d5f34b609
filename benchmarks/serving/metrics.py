"""What one run measured, reduced to the figures serving benchmarks report (SGLang's and
vLLM's `bench_serving` names): throughput, TTFT, ITL, TPOT and end-to-end latency
percentiles, errors by kind, and the prefix-cache hit rate."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

HIT_TOKENS = "radixserve_prefix_cache_hit_tokens_total"
QUERY_TOKENS = "radixserve_prefix_cache_query_tokens_total"
PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds; `itls` are the gaps between
    successive chunks that carried output (one chunk may carry several tokens)."""

    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float | None = None
    error: str | None = None
    """The kind of failure (`http_503`, `timeout`, `wrong_output_len`, ...), None on success."""
    cached_tokens: int | None = None
    """Prompt tokens the server reported as served from its cache (usage), if it did."""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: per token, however the stream was chunked."""
        if self.latency is None or self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds; None when no request had the value."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, seconds: Iterable[float]) -> LatencyStats:
        ms = sorted(s * 1000 for s in seconds)
        if not ms:
            return cls(None, None, None, None)
        p50, p90, p99 = (percentile(ms, p) for p in PERCENTILES)
        return cls(sum(ms) / len(ms), p50, p90, p99)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_throughput: float
    """Output tokens of completed requests per second of the whole run."""
    total_throughput: float
    """Prompt plus output tokens of completed requests per second."""
    prompt_tokens: int
    output_tokens: int
    ttft_ms: LatencyStats
    itl_ms: LatencyStats
    tpot_ms: LatencyStats
    e2e_ms: LatencyStats
    cached_prompt_fraction: float | None
    """Cached prompt tokens over prompt tokens, from the responses' usage."""
    radix_hit_rate: float | None
    """Hit tokens over query tokens of the server's prefix cache during the run, from its
    /metrics; None when the server does not export the counters."""


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


def summarize(
    results: Sequence[RequestResult], duration_s: float, radix_hit_rate: float | None = None
) -> Summary:
    ok = [r for r in results if r.error is None]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    reported_prompt = sum(r.prompt_len for r in reported)
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    return Summary(
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=dict(Counter(r.error for r in results if r.error is not None)),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=output_tokens * per_s,
        total_throughput=(prompt_tokens + output_tokens) * per_s,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        ttft_ms=LatencyStats.of(r.ttft for r in ok if r.ttft is not None),
        itl_ms=LatencyStats.of(gap for r in ok for gap in r.itls),
        tpot_ms=LatencyStats.of(t for r in ok if (t := r.tpot) is not None),
        e2e_ms=LatencyStats.of(r.latency for r in ok if r.latency is not None),
        cached_prompt_fraction=(
            sum(r.cached_tokens or 0 for r in reported) / reported_prompt
            if reported_prompt
            else None
        ),
        radix_hit_rate=radix_hit_rate,
    )


def cache_counters(metrics_text: str) -> tuple[float, float] | None:
    """(hit tokens, query tokens) summed over label sets, or None when either is absent:
    an older server, or not ours."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in (HIT_TOKENS, QUERY_TOKENS):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if HIT_TOKENS not in totals or QUERY_TOKENS not in totals:
        return None
    return totals[HIT_TOKENS], totals[QUERY_TOKENS]


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Hits over queries between two scrapes; None without both scrapes or without queries."""
    if before is None or after is None:
        return None
    queried = after[1] - before[1]
    return (after[0] - before[0]) / queried if queried > 0 else None


FORWARD_TIME = "radixserve_forward_time_seconds"
CPU_INFO = "radixserve_cpu_info"


def cpu_info(metrics_text: str) -> dict[str, str] | None:
    """The labels of the worker's `radixserve_cpu_info` gauge (`isa`, `dtype`, `weights`:
    what the model runs as, after `auto` was resolved), or None when it does not export it."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == CPU_INFO:
            for sample in family.samples:
                return dict(sample.labels)
    return None


@dataclass(frozen=True)
class HistogramSnapshot:
    """One scrape of a Prometheus histogram (one label set): cumulative bucket counts by
    upper bound, the sum and the count. Two scrapes' difference is what happened between."""

    buckets: tuple[tuple[float, float], ...]
    """(upper bound, cumulative count), ascending, +Inf last."""
    sum: float
    count: float

    def __sub__(self, other: HistogramSnapshot) -> HistogramSnapshot:
        before = dict(other.buckets)
        return HistogramSnapshot(
            tuple((le, n - before.get(le, 0.0)) for le, n in self.buckets),
            self.sum - other.sum,
            self.count - other.count,
        )

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' `histogram_quantile`: linear within the bucket the rank falls in."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for upper, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(upper):
                    return lower
                inside = cumulative - below
                return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
            lower, below = upper, cumulative
        return lower


def forward_time(metrics_text: str, mode: str = "decode") -> HistogramSnapshot | None:
    """The worker's `radixserve_forward_time_seconds{mode=...}` histogram in a /metrics
    text, or None when it does not export it."""
    buckets: dict[float, float] = {}
    total = count = None
    for family in text_string_to_metric_families(metrics_text):
        if family.name != FORWARD_TIME:
            continue
        for sample in family.samples:
            if sample.labels.get("mode") != mode:
                continue
            if sample.name == FORWARD_TIME + "_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == FORWARD_TIME + "_sum":
                total = (total or 0.0) + sample.value
            elif sample.name == FORWARD_TIME + "_count":
                count = (count or 0.0) + sample.value
    if total is None or count is None:
        return None
    return HistogramSnapshot(tuple(sorted(buckets.items())), total, count)


def scrape_forward(url: str) -> HistogramSnapshot:
    """The worker's decode forward-time histogram at `url` now; empty before its first
    decode step."""
    import httpx2

    snapshot = forward_time(httpx2.get(url, timeout=10.0, trust_env=False).text)
    return snapshot or HistogramSnapshot((), 0.0, 0.0)


def forward_summary(delta: HistogramSnapshot) -> dict[str, float | None]:
    """Milliseconds: p50 interpolated within the buckets, and the exact mean; step count."""
    p50, mean = delta.quantile(0.5), delta.mean
    return {
        "p50": None if p50 is None else p50 * 1000,
        "mean": None if mean is None else mean * 1000,
        "steps": delta.count,
    }
