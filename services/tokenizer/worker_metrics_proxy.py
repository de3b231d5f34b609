"""The worker's series on the API port: the tokenizer's `/metrics` fetches the worker's
`/metrics` over loopback at scrape time and appends it to its own exposition.

A scraper that reads only the serving port (the Gateway API Inference Extension's endpoint
picker, llm-d's router) then sees the queue and KV gauges beside the tokenizer's latencies.
Nothing is cached: each scrape shows the worker's copy of the scheduler's counters as it is
then. When the worker does not answer within `WORKER_SCRAPE_TIMEOUT_S` (loading, dead,
stuck), the tokenizer still answers with its own series and counts the miss in
`radixserve_worker_metrics_scrape_failures_total`. Without `--worker-metrics-port` (a
tokenizer started alone; `radixserve serve` always passes the port it chose) there is no
worker port to read, and the API port serves the tokenizer's series alone.

The fetch is the standard library's urllib on a thread: one short GET per scrape needs no
HTTP client dependency.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.request

from observability.metrics import TokenizerMetrics

logger = logging.getLogger(__name__)

WORKER_SCRAPE_TIMEOUT_S = 1.0
"""Well under a scrape interval (15 s) and a Prometheus scrape timeout (10 s)."""
MAX_EXPOSITION_BYTES = 16 * 2**20
"""A worker answer past this is refused rather than held in memory (a real one is ~20 kB)."""


def loopback_host(host: str) -> str:
    """The address the worker's `/metrics` is reached at from this pod: it binds on `--host`,
    so a wildcard is reached through the loopback of its family."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


class WorkerMetricsProxy:
    """Fetches the worker's exposition for the tokenizer's `/metrics`."""

    def __init__(
        self,
        host: str,
        port: int | None,
        metrics: TokenizerMetrics,
        timeout: float = WORKER_SCRAPE_TIMEOUT_S,
    ):
        self.host = loopback_host(host)
        self.port = port
        self.metrics = metrics
        self.timeout = timeout
        self._collisions_logged: set[str] = set()
        if port is None:
            logger.warning(
                "no --worker-metrics-port: the API port's /metrics leaves out the worker's series"
            )

    async def scrape(self) -> bytes:
        """The worker's exposition, or b"" (counted, logged at debug) when it cannot be had."""
        if self.port is None:
            return b""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._get("/metrics")
        except (OSError, TimeoutError, ValueError) as exc:
            self.metrics.worker_scrape_failures.inc()
            reason = str(exc) or type(exc).__name__
            logger.debug("no worker series from %s:%d: %s", self.host, self.port, reason)
            return b""

    def merged(self, own: bytes, worker: bytes) -> bytes:
        """`own` followed by the worker's families, less any whose name `own` already has
        (none today: the names are disjoint; one family twice would be rejected whole by
        Prometheus, so the tokenizer's wins and the clash is logged once)."""
        if not worker:
            return own
        own_names = _family_names(own)
        kept: list[bytes] = []
        for name, block in _family_blocks(worker):
            if name in own_names:
                if name not in self._collisions_logged:
                    self._collisions_logged.add(name)
                    logger.warning("the worker's metric %s is also the tokenizer's: left out", name)
                continue
            kept.append(block)
        return own + b"".join(kept)

    async def _get(self, path: str) -> bytes:
        """The body of a 200 answer to GET `path`, read on a thread (urllib blocks)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        url = f"http://{host}:{self.port}{path}"
        return await asyncio.to_thread(_read, url, self.timeout)


def _read(url: str, timeout: float) -> bytes:
    """OSError (urllib's errors among them) for no answer or one that is not a 200."""
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        body: bytes = answer.read(MAX_EXPOSITION_BYTES + 1)
    if len(body) > MAX_EXPOSITION_BYTES:
        raise ValueError(f"answer larger than {MAX_EXPOSITION_BYTES} bytes")
    return body


def _family_names(exposition: bytes) -> set[str]:
    return {
        line.split(b" ", 3)[2].decode()
        for line in exposition.splitlines()
        if line.startswith(b"# TYPE ")
    }


def _family_blocks(exposition: bytes) -> list[tuple[str, bytes]]:
    """The exposition cut into its families, each (name, its lines): a family opens with its
    `# HELP` or `# TYPE` line, and its samples follow."""
    blocks: list[tuple[str, list[bytes]]] = []
    for line in exposition.splitlines(keepends=True):
        if line.startswith((b"# HELP ", b"# TYPE ")):
            name = line.split(b" ", 3)[2].decode().strip()
            if not blocks or blocks[-1][0] != name:
                blocks.append((name, []))
        elif not blocks:
            blocks.append(("", []))
        blocks[-1][1].append(line)
    return [(name, b"".join(lines)) for name, lines in blocks]
