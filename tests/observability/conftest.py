"""One running system for the observability tests: the three services as real processes,
a real Prometheus scraping them, and an OTLP/HTTP receiver collecting their spans.

`system` runs the traffic every test then inspects: shared-prefix streams (radix hits,
TTFT, inter-token latency), a grammar request, and concurrent long requests on a KV pool
too small for them (retractions).
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from testing.launcher import ServiceLauncher, cpu_flags, server_ports
from testing.net import free_port, wait_until
from tests.observability.dashboard import RULES

MODEL = "tiny-llama"
MAX_TOTAL_TOKENS = 300
"""Ample for one shared-prefix request at a time, far too small for the concurrent burst."""
HEARTBEAT_INTERVAL = 1.0
"""As in the serve test: a CPU shared with the long burst must not make a process look dead."""
PREFIX = (
    "You are a careful assistant who answers questions about geography, history and science "
    "in plain words. "
) * 3
QUESTIONS = ("the Alps", "the Nile", "volcanoes", "the Moon", "glaciers", "deserts")
SHARED_MAX_TOKENS = 12
BURST = 8
BURST_MAX_TOKENS = 64
"""Concurrent long requests: together they need ~670 KV slots of the 300."""


def require_binary(name: str) -> str:
    """The binary's path. Missing, the test fails: `make test` installs the prometheus
    package first (deploy/system_deps.sh), and a skipped check proves nothing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: run deploy/system_deps.sh test")
    return path


# ----- OTLP/HTTP receiver -------------------------------------------------------------------


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str


class OtlpReceiver:
    """Accepts OTLP/HTTP protobuf trace exports on 127.0.0.1 and keeps their spans."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.spans += [
                    ReceivedSpan(
                        attributes.get("service.name", ""),
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                    )
                    for s in scope_spans.spans
                ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ----- Prometheus -------------------------------------------------------------------------


class Prometheus:
    """A real Prometheus server on a free port, scraping `targets` (job → host:port) every
    second and loading the alert rules, with its data in `workdir`."""

    def __init__(self, binary: str, targets: dict[str, str], workdir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]}
                for job, target in targets.items()
            ],
        }
        config_file = workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        self.log = workdir / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def query(self, expr: str) -> list[dict]:
        """The result vector of an instant query (an error is a failed assertion)."""
        reply = httpx2.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert reply["status"] == "success", f"{expr}: {reply}"
        return reply["data"]["result"]

    def value(self, expr: str) -> float:
        """The single value of `expr`, NaN when it has none."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ----- the system -------------------------------------------------------------------------


@dataclass
class System:
    base_url: str
    metrics_urls: dict[str, str]
    """role → its /metrics URL."""
    receiver: OtlpReceiver
    prometheus: Prometheus | None
    prometheus_missing: str | None = None
    traffic: dict[str, Any] = field(default_factory=dict)

    def metrics_text(self, role: str) -> str:
        return httpx2.get(self.metrics_urls[role], timeout=5).text

    def require_prometheus(self) -> Prometheus:
        if self.prometheus is None:
            require_binary("prometheus")
        return self.prometheus


def _completion(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A completion; when streamed, the number of events stands in for the answer."""
    body = {"model": MODEL, "temperature": 0, **body}
    if not body.get("stream"):
        reply = httpx2.post(f"{base_url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()
    with httpx2.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        return {"events": sum(1 for line in reply.iter_lines() if line.startswith("data:"))}


def run_traffic(base_url: str) -> dict[str, Any]:
    shared = [
        _completion(
            base_url,
            {
                "prompt": f"{PREFIX}Tell me about {q}.",
                "max_tokens": SHARED_MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
            },
        )
        for q in QUESTIONS
    ]
    grammar = _completion(
        base_url, {"prompt": "Three digits:", "max_tokens": 8, "regex": "[0-9]{3}"}
    )
    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        burst = list(
            pool.map(
                lambda i: _completion(
                    base_url,
                    {
                        "prompt": f"Request {i} of the burst: write a long story about the sea "
                        f"and ships number {i}.",
                        "max_tokens": BURST_MAX_TOKENS,
                        "ignore_eos": True,
                    },
                ),
                range(BURST),
            )
        )
    return {"shared": shared, "grammar": grammar, "burst": burst}


@pytest.fixture(scope="session")
def system(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    receiver = OtlpReceiver()
    # Spans leave within 0.1 s instead of the default 5 s.
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    launcher = ServiceLauncher(
        tmp_path_factory.mktemp("observability-logs"), HEARTBEAT_INTERVAL, env=otel
    )
    ports = server_ports()  # chosen first: Prometheus is told its targets before they run
    flags = [*cpu_flags(MAX_TOTAL_TOKENS, tiny_llama_dir), "--served-model-name", MODEL]
    targets = {
        "tokenizer": f"127.0.0.1:{ports['port']}",
        "worker": f"127.0.0.1:{ports['worker-metrics-port']}",
        "detokenizer": f"127.0.0.1:{ports['detokenizer-metrics-port']}",
    }
    # Scraped as the chart's ServiceMonitor does: the API port carries the worker's series.
    scraped = {f"radixserve-{role}": targets[role] for role in ("tokenizer", "detokenizer")}
    binary = shutil.which("prometheus")
    # Started first: it takes seconds to come up, the model loads meanwhile.
    prometheus = (
        Prometheus(binary, scraped, tmp_path_factory.mktemp("prometheus")) if binary else None
    )
    system = System(
        base_url=f"http://127.0.0.1:{ports['port']}",
        metrics_urls={role: f"http://{target}/metrics" for role, target in targets.items()},
        receiver=receiver,
        prometheus=prometheus,
    )
    phases = {}  # seconds per setup phase, printed with the logs: where a slow run spent its time
    try:
        started = time.monotonic()
        with launcher.serve(flags, timeout=120, ports=ports):
            phases["start"] = time.monotonic() - started
            if prometheus is not None:
                wait_until(
                    lambda: prometheus.value('count(up{job=~"radixserve-.*"} == 1)') == 2,
                    60,
                    "Prometheus to scrape the API and detokenizer ports",
                )
            phases["first scrape"] = time.monotonic() - started - sum(phases.values())
            system.traffic = run_traffic(system.base_url)
            phases["traffic"] = time.monotonic() - started - sum(phases.values())
            if prometheus is not None:  # the counters Prometheus holds are the final ones
                requests = len(QUESTIONS) + 1 + BURST
                wait_until(
                    lambda: (
                        prometheus.value("sum(radixserve_e2e_request_latency_seconds_count)")
                        == requests
                        and prometheus.value("sum(radixserve_num_requests_running)") == 0
                    ),
                    30,
                    "Prometheus to scrape the finished traffic",
                )
            phases["last scrape"] = time.monotonic() - started - sum(phases.values())
            yield system
    finally:
        print(
            "system setup seconds:", {phase: round(seconds, 1) for phase, seconds in phases.items()}
        )
        if prometheus is not None:
            prometheus.close()
        receiver.close()
