"""Sends a workload to an OpenAI-compatible server and times every streamed request.

Requests go out in workload order, at a seeded Poisson rate or all at once, and at most
`concurrency` are in flight (a closed loop, like SGLang's `--max-concurrency`). A
request's clock starts when it is sent, after it got a slot, so TTFT is the server's
time and not the client's queue. A multi-turn request waits for its previous turn.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import httpx2

from benchmarks.serving.metrics import RequestResult, cache_counters, hit_rate
from benchmarks.serving.workloads import BenchRequest

Prompt = list[int] | str


@dataclass
class RunResult:
    results: list[RequestResult]
    duration_s: float
    radix_hit_rate: float | None


def arrival_times(n: int, request_rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request becomes due: a Poisson process of
    `request_rate` per second, or all at 0 when the rate is None (or infinite)."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(request_rate)
        times.append(t)
    return times


async def dispatch(
    requests: Sequence[BenchRequest],
    send: Callable[[int], Awaitable[RequestResult]],
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
) -> list[RequestResult]:
    """`send(i)` for every request: once due, once its `after` request finished (whether
    or not it succeeded: the history it resends is fixed), and within the concurrency cap."""
    slots = asyncio.Semaphore(concurrency) if concurrency else nullcontext()
    finished = [asyncio.Event() for _ in requests]
    results: list[RequestResult | None] = [None] * len(requests)
    start = time.perf_counter()
    due = arrival_times(len(requests), request_rate, seed)

    async def one(i: int) -> None:
        try:
            if (delay := start + due[i] - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            if (after := requests[i].after) is not None:
                await finished[after].wait()
            async with slots:
                results[i] = await send(i)
        finally:
            finished[i].set()

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    return [r for r in results if r is not None]


def completion_payload(model: str, prompt: Prompt, output_len: int) -> dict[str, Any]:
    """Greedy, exactly `output_len` tokens (`ignore_eos`: vLLM's and SGLang's extra, which
    radixserve accepts too), streamed with a closing usage chunk to count tokens by."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    http: httpx2.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int
) -> RequestResult:
    """POST one streaming completion and time its chunks. Never raises for a failed request:
    the failure's kind goes into `error`."""
    result = RequestResult(prompt_len=prompt_len)
    start = last = time.perf_counter()
    chunks, usage, done = 0, None, False
    try:
        async with http.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"http_{response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    result.error = "invalid_event"
                    return result
                if "error" in event:
                    result.error = f"stream_error:{(event['error'] or {}).get('code') or 'unknown'}"
                    return result
                now = time.perf_counter()
                if any(choice.get("text") for choice in event.get("choices") or ()):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    chunks, last = chunks + 1, now
                usage = event.get("usage") or usage
    except httpx2.TimeoutException:
        result.error = "timeout"
        return result
    except httpx2.HTTPError as e:
        result.error = f"transport:{type(e).__name__}"
        return result
    result.latency = time.perf_counter() - start
    if usage:
        result.prompt_len = usage.get("prompt_tokens", prompt_len)
        result.output_len = usage.get("completion_tokens", chunks)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        result.output_len = chunks
    if not done:
        result.error = "incomplete_stream"
    elif result.output_len != payload["max_tokens"]:
        result.error = "wrong_output_len"
    return result


async def scrape_cache_counters(
    http: httpx2.AsyncClient, urls: Sequence[str]
) -> tuple[float, float] | None:
    """The prefix-cache counters from the first of `urls` that exports them; None when none
    does or none answers (the benchmark must run against any server)."""
    for url in urls:
        try:
            response = await http.get(url)
        except httpx2.HTTPError:
            continue
        if response.status_code == 200 and (counters := cache_counters(response.text)) is not None:
            return counters
    return None


async def discover_metrics_urls(http: httpx2.AsyncClient, base_url: str) -> list[str]:
    """`BASE/metrics`, and before it radixserve's worker /metrics (where its cache counters
    live), found from the port in `/get_server_info` when the server answers that."""
    urls = [f"{base_url}/metrics"]
    try:
        response = await http.get(f"{base_url}/get_server_info")
        port = response.json().get("worker_metrics_port") if response.status_code == 200 else None
    except (httpx2.HTTPError, ValueError):
        port = None
    if isinstance(port, int):
        urls.insert(0, str(httpx2.URL(base_url).copy_with(port=port, path="/metrics")))
    return urls


async def served_model(http: httpx2.AsyncClient, base_url: str) -> str:
    response = await http.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def new_http_client(concurrency: int | None, timeout_s: float) -> httpx2.AsyncClient:
    limits = httpx2.Limits(
        max_connections=concurrency or 1000, max_keepalive_connections=concurrency or 1000
    )
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False
    )


async def run(
    base_url: str,
    requests: Sequence[BenchRequest],
    prompts: Sequence[Prompt],
    *,
    model: str | None = None,
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    metrics_urls: Sequence[str] | None = None,
    warmup: Sequence[Prompt] = (),
    timeout_s: float = 600.0,
) -> RunResult:
    """Run `requests` (sent as `prompts`, token ids or text) against `base_url`. `warmup`
    prompts go first, one at a time and unmeasured; they should share nothing with the
    workload, or they would seed the server's cache. `metrics_urls` None: discovered."""
    url = f"{base_url}/v1/completions"
    async with new_http_client(concurrency, timeout_s) as http:
        model = model or await served_model(http, base_url)
        if metrics_urls is None:
            metrics_urls = await discover_metrics_urls(http, base_url)
        for prompt in warmup:
            if error := (
                await stream_completion(http, url, completion_payload(model, prompt, 4), 0)
            ).error:
                raise RuntimeError(f"the warm-up request to {url} failed: {error}")
        before = await scrape_cache_counters(http, metrics_urls)
        start = time.perf_counter()
        results = await dispatch(
            requests,
            lambda i: stream_completion(
                http,
                url,
                completion_payload(model, prompts[i], requests[i].output_len),
                len(requests[i].prompt),
            ),
            concurrency,
            request_rate,
            seed,
        )
        duration = time.perf_counter() - start
        after = await scrape_cache_counters(http, metrics_urls)
    return RunResult(results, duration, hit_rate(before, after))
