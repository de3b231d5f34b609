"""The replicas of a fleet: N radixserve servers on loopback, started at once, each read
through its own counters.

A replica is the three services of one server (`ServiceLauncher`), so its worker metrics
port, where the prefix-cache counters live, is known without asking. Starting them all
before waiting for any lets their model loads overlap.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving.metrics import HIT_TOKENS, QUERY_TOKENS
from testing.launcher import ROLES, SERVER_PORTS, ServiceLauncher, port_flags
from testing.net import all_kv_free, free_ports, wait_until

PREFILL_TOKENS = "radixserve_prompt_tokens_total"
"""The worker's prompt tokens computed by prefill (radix hits excluded)."""
FINISHED_REQUESTS = "radixserve_e2e_request_latency_seconds_count"
"""The tokenizer's finished generation requests: how many requests a replica served."""
KV_EVENTS_TOPIC = "kv"
KV_EVENTS_BLOCK_SIZE = 16
SETTLE_INTERVAL_S = 0.3
"""Longer than the worker's metrics sampling interval (0.25 s): two scrapes this far apart
that agree show the counters caught up with the last request."""
FLUSH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Counters:
    """One replica's cumulative counters at a scrape; subtract two for a run's share."""

    hit_tokens: float
    query_tokens: float
    prefill_tokens: float
    requests: float

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.hit_tokens - other.hit_tokens,
            self.query_tokens - other.query_tokens,
            self.prefill_tokens - other.prefill_tokens,
            self.requests - other.requests,
        )


def sample_total(metrics_text: str, name: str) -> float:
    """The sum of the samples called `name` over their label sets (0 when there is none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == name
    )


@dataclass
class Replica:
    """One server of the fleet; `kv_events_endpoint` is where it publishes its KV-cache
    events, or None when it does not."""

    index: int
    launcher: ServiceLauncher
    ports: dict[str, int]
    kv_events_endpoint: str | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['port']}"

    @property
    def worker_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['worker-metrics-port']}/metrics"

    def http(self) -> httpx2.Client:
        return httpx2.Client(base_url=self.base_url, timeout=30.0, trust_env=False)

    def model_info(self) -> tuple[str, str]:
        """The served model's id and its tokenizer's path."""
        with self.http() as http:
            response = http.get("/get_model_info")
            response.raise_for_status()
            info = response.json()
        return str(info["served_model_name"]), str(info["tokenizer_path"])

    def counters(self) -> Counters:
        """The cache and prefill counters from the worker's /metrics, the finished requests
        from the tokenizer's (the API port's)."""
        worker = httpx2.get(self.worker_metrics_url, timeout=10.0, trust_env=False)
        api = httpx2.get(f"{self.base_url}/metrics", timeout=10.0, trust_env=False)
        worker.raise_for_status()
        api.raise_for_status()
        return Counters(
            hit_tokens=sample_total(worker.text, HIT_TOKENS),
            query_tokens=sample_total(worker.text, QUERY_TOKENS),
            prefill_tokens=sample_total(worker.text, PREFILL_TOKENS),
            requests=sample_total(api.text, FINISHED_REQUESTS),
        )

    def settled_counters(self, timeout: float = 30.0) -> Counters:
        """Counters once two scrapes SETTLE_INTERVAL_S apart agree. The worker samples its
        counters on a turn of its loop, and an idle loop turns only when a message wakes
        it: each try asks for /get_server_info first, which does."""
        with self.http() as http:
            previous: list[Counters] = []

            def settled() -> bool:
                http.get("/get_server_info").raise_for_status()
                time.sleep(SETTLE_INTERVAL_S)
                previous.append(self.counters())
                return len(previous) >= 2 and previous[-1] == previous[-2]

            wait_until(settled, timeout, f"replica {self.index}'s counters to settle", 0)
        return previous[-1]

    def is_idle(self, timeout: float = 30.0) -> bool:
        """Whether the replica comes back to idle within `timeout`: nothing running or
        waiting, and every KV slot free or evictable (`available + evictable == total`)."""
        deadline = time.monotonic() + timeout
        with self.http() as http:
            while not all_kv_free(http):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
        return True

    def flush_cache(self) -> None:
        """Empties the radix tree (retried while the worker still finishes requests: 409)."""
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        with self.http() as http:
            while (response := http.post("/flush_cache")).status_code == 409:
                assert time.monotonic() < deadline, f"replica {self.index} refused /flush_cache"
                time.sleep(0.5)
            response.raise_for_status()


def _signal_all(replicas: Sequence[Replica]) -> None:
    """SIGTERM to every process of every replica; each launcher's `stop_all` then reaps."""
    for replica in replicas:
        for proc in replica.launcher.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)


def kv_events_flags(port: int) -> list[str]:
    """`--kv-events-config` publishing on 127.0.0.1:`port`, and the block size."""
    config = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": KV_EVENTS_TOPIC,
        "replay_endpoint": None,
    }
    return [
        "--kv-events-config",
        json.dumps(config),
        "--kv-events-block-size",
        str(KV_EVENTS_BLOCK_SIZE),
    ]


@contextmanager
def start_fleet(
    n: int,
    flags: Sequence[str],
    log_dir: Path,
    *,
    kv_events: bool = False,
    heartbeat_interval: float | None = None,
    timeout: float = 300.0,
    show_logs: bool = False,
) -> Iterator[list[Replica]]:
    """`n` servers with `flags` (and, with `kv_events`, each publishing its KV events on a
    port of its own), all started before any is waited for; yields them once every one
    answers /health, and stops them all after, whatever happened."""
    # Every port of the fleet drawn at once, so no two of them can be the same.
    per_replica = len(SERVER_PORTS) + 1
    all_ports = free_ports(n * per_replica)
    with ExitStack() as stack:
        replicas = []
        for i in range(n):
            *own, events_port = all_ports[i * per_replica : (i + 1) * per_replica]
            ports = dict(zip(SERVER_PORTS, own))
            replica_dir = log_dir / f"replica-{i}"
            replica_dir.mkdir(parents=True, exist_ok=True)
            launcher = ServiceLauncher(replica_dir, heartbeat_interval, show_logs=show_logs)
            stack.callback(launcher.stop_all)
            endpoint, extra = None, []
            if kv_events:
                endpoint, extra = f"tcp://127.0.0.1:{events_port}", kv_events_flags(events_port)
            replica_flags = [*flags, *extra, "--host", "127.0.0.1", *port_flags(ports)]
            for role in ROLES:
                launcher.start(role, replica_flags)
            replicas.append(Replica(i, launcher, ports, endpoint))
        stack.callback(_signal_all, replicas)  # runs first: every replica stops at once
        deadline = time.monotonic() + timeout
        for replica in replicas:
            replica.launcher.wait_ready(replica.base_url, max(1.0, deadline - time.monotonic()))
        yield replicas
