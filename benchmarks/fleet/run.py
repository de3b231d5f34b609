"""One workload through one way of routing it, measured on the replicas' own counters.

Modes: `single` (every request to the first replica, the baseline a fleet must keep),
smg's `cache_aware` and `round_robin`, and `precise` (routed by the replicas' KV events,
see `precise.py`). Before each mode every replica's cache is flushed, so no mode inherits
another's prefixes; smg starts fresh for each, so its tree starts empty too.

The fleet hit rate is Σ hit / Σ query tokens over the replicas' prefix-cache counters
between the mode's start and end; prefill tokens are Σ Δ `radixserve_prompt_tokens_total`
(tokens actually computed); load is each replica's Δ finished requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx2

from benchmarks.fleet.gateway import smg_gateway
from benchmarks.fleet.precise import KvEventIndex, choose
from benchmarks.fleet.replicas import KV_EVENTS_BLOCK_SIZE, KV_EVENTS_TOPIC, Counters, Replica
from benchmarks.serving.client import (
    completion_payload,
    dispatch,
    new_http_client,
    stream_completion,
)
from benchmarks.serving.metrics import RequestResult, Summary, summarize
from benchmarks.serving.workloads import BenchRequest
from engine.cache.kv_events import block_hashes

MODES = ("single", "cache_aware", "round_robin", "precise")
TEXT_CHUNK_TOKENS = 16
"""Prompts become text 16 tokens at a time, from the start: two prompts that share their
first k tokens then share the text of their first k // 16 chunks exactly, whatever a
token split across a chunk's end decodes to."""
EVENT_WAIT_S = 10.0
"""How long the precise router waits for a request's blocks to show in the events."""

T = TypeVar("T")


def text_prompt(tokenizer: Any, prompt: Sequence[int]) -> str:
    return "".join(
        tokenizer.decode(prompt[i : i + TEXT_CHUNK_TOKENS])
        for i in range(0, len(prompt), TEXT_CHUNK_TOKENS)
    )


def subscribe(replicas: Sequence[Replica]) -> KvEventIndex:
    """A `KvEventIndex` of every replica's events (all must publish them)."""
    endpoints = [r.kv_events_endpoint for r in replicas]
    if None in endpoints:
        raise ValueError("the precise mode needs every replica started with kv_events")
    return KvEventIndex([e for e in endpoints if e is not None], KV_EVENTS_TOPIC)


def warm_up(replicas: Sequence[Replica], model: str, prompt: str) -> None:
    """One short request per replica, sharing nothing with the workloads: the first
    request of a fresh server pays for what later ones find ready."""
    payload = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    for replica in replicas:
        with replica.http() as http:
            http.post("/v1/completions", json=payload, timeout=300).raise_for_status()


@dataclass
class ModeResult:
    mode: str
    summary: Summary
    per_replica: list[Counters]
    """Each replica's counters over the mode (deltas)."""
    idle: list[bool]
    """Each replica back to idle at the end: `available + evictable == total` KV."""
    lost: int
    """Requests sent that did not come back complete."""
    event_waits_timed_out: int = 0
    """Precise mode: choices made before the previous request's events had all arrived."""

    @property
    def hit_rate(self) -> float:
        query = sum(c.query_tokens for c in self.per_replica)
        return sum(c.hit_tokens for c in self.per_replica) / query if query else 0.0

    @property
    def prefill_tokens(self) -> int:
        return int(sum(c.prefill_tokens for c in self.per_replica))

    @property
    def requests_per_replica(self) -> list[int]:
        return [int(c.requests) for c in self.per_replica]


def on_all(replicas: Sequence[Replica], fn: Callable[[Replica], T]) -> list[T]:
    """`fn` on every replica at once (each call mostly waits on the replica)."""
    with ThreadPoolExecutor(len(replicas)) as pool:
        return list(pool.map(fn, replicas))


async def send_all(
    requests: Sequence[BenchRequest],
    send: Callable[[int], Awaitable[RequestResult]],
    concurrency: int,
) -> list[RequestResult]:
    """One at a time in workload order with `concurrency` 1 (so a seed fixes every routing
    decision), else `dispatch`'s closed loop."""
    if concurrency == 1:
        return [await send(i) for i in range(len(requests))]
    return await dispatch(requests, send, concurrency)


class FleetRun:
    """The modes of one workload on one fleet. `counters` carries each replica's counters
    from the end of one mode to the start of the next (a flush does not move them)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        requests: Sequence[BenchRequest],
        prompts: Sequence[str],
        model: str,
        log_dir: Path,
        *,
        events: KvEventIndex | None = None,
        concurrency: int = 1,
        timeout_s: float = 600.0,
        smg_flags: Sequence[str] = (),
    ):
        self.replicas = list(replicas)
        self.requests = list(requests)
        self.prompts = list(prompts)
        self.model = model
        self.log_dir = log_dir
        self.events = events
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.smg_flags = list(smg_flags)
        self.counters = on_all(self.replicas, Replica.settled_counters)

    def run(self, mode: str) -> ModeResult:
        on_all(self.replicas, Replica.flush_cache)
        waits_timed_out = 0
        if mode == "single":
            start = time.perf_counter()
            results = asyncio.run(self._send_to(self.replicas[0].base_url))
            duration = time.perf_counter() - start
        elif mode == "precise":
            chains = self.chains()  # rendered before the clock: the router's work, not the fleet's
            start = time.perf_counter()
            results, waits_timed_out = asyncio.run(self._send_precise(chains))
            duration = time.perf_counter() - start
        else:
            urls = [r.base_url for r in self.replicas]
            log = self.log_dir / f"smg-{mode}.log"
            with smg_gateway(urls, mode, log, self.smg_flags) as base_url:
                start = time.perf_counter()
                results = asyncio.run(self._send_to(base_url))
                duration = time.perf_counter() - start
        idle = on_all(self.replicas, Replica.is_idle)
        after = on_all(self.replicas, Replica.settled_counters)
        per_replica = [a - b for a, b in zip(after, self.counters)]
        self.counters = after
        summary = summarize(results, duration)
        lost = len(self.requests) - summary.completed
        return ModeResult(mode, summary, per_replica, idle, lost, waits_timed_out)

    def _payload(self, i: int) -> dict[str, Any]:
        return completion_payload(self.model, self.prompts[i], self.requests[i].output_len)

    async def _send_to(self, base_url: str) -> list[RequestResult]:
        url = f"{base_url}/v1/completions"
        async with new_http_client(self.concurrency, self.timeout_s) as http:
            return await send_all(
                self.requests,
                lambda i: stream_completion(
                    http, url, self._payload(i), len(self.requests[i].prompt)
                ),
                self.concurrency,
            )

    async def _send_precise(
        self, chains: Sequence[Sequence[int]]
    ) -> tuple[list[RequestResult], int]:
        """Request i to `choose`'s replica for `chains[i]`, one at a time; after each, until
        that replica's events hold the prompt's blocks."""
        events = self.events
        assert events is not None
        if not await asyncio.to_thread(events.wait_cleared, EVENT_WAIT_S):
            raise RuntimeError("the KV events did not show the flush of every replica")
        assigned = [0] * len(self.replicas)
        results, timed_out = [], 0
        async with new_http_client(1, self.timeout_s) as http:
            for i, chain in enumerate(chains):
                r = choose(chain, events.snapshot(), assigned)
                assigned[r] += 1
                url = f"{self.replicas[r].base_url}/v1/completions"
                prompt_len = len(self.requests[i].prompt)
                results.append(await stream_completion(http, url, self._payload(i), prompt_len))
                if not await asyncio.to_thread(events.wait_for, r, chain, EVENT_WAIT_S):
                    timed_out += 1
        return results, timed_out

    def chains(self) -> list[list[int]]:
        """Each prompt's block-hash chain, as the replicas' events hash it."""
        if self.events is None:
            raise RuntimeError("the precise mode needs the replicas' KV events")
        return [block_hashes(ids, None, KV_EVENTS_BLOCK_SIZE) for ids in self.token_ids()]

    def token_ids(self) -> list[list[int]]:
        """The ids the worker sees for each request, from the first replica's
        `/v1/completions/render` (every replica has the same tokenizer): what a router that
        routes by blocks asks before it chooses."""
        with httpx2.Client(base_url=self.replicas[0].base_url, timeout=60, trust_env=False) as h:
            ids = []
            for i in range(len(self.prompts)):
                response = h.post("/v1/completions/render", json=self._payload(i))
                response.raise_for_status()
                ids.append(response.json()[0]["token_ids"])
        return ids
