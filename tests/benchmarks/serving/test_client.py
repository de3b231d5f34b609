"""The client against a small real HTTP server that streams like an OpenAI server, and
its scheduling (rate, concurrency cap, turn order) against a fake sender."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from benchmarks.serving import client
from benchmarks.serving.metrics import HIT_TOKENS, QUERY_TOKENS, RequestResult
from benchmarks.serving.workloads import BenchRequest
from testing.net import free_port

FAIL_503, FAIL_IN_STREAM, SHORT_OUTPUT = 1, 2, 3
"""A prompt starting with one of these ids makes the stub fail that way."""


class StubServer:
    """Streams one chunk per token (`max_tokens` of them), then usage claiming half the
    prompt was cached; counts the cache counters and the most requests seen in flight."""

    def __init__(self) -> None:
        self.hit = self.query = 0
        self.in_flight = self.max_in_flight = 0
        self.bodies: list[dict] = []
        self.worker_metrics_port: int | None = None
        """Served in /get_server_info once set, as radixserve does."""
        self.app = FastAPI()
        self.app.get("/v1/models")(lambda: {"data": [{"id": "stub-model"}]})
        self.app.get("/get_server_info")(self.server_info)
        self.app.get("/metrics")(self.metrics)
        self.app.post("/v1/completions")(self.completions)

    def server_info(self) -> Response:
        if self.worker_metrics_port is None:
            return JSONResponse({"error": {"message": "not found"}}, 404)
        return JSONResponse({"worker_metrics_port": self.worker_metrics_port})

    def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(
            f"# TYPE {HIT_TOKENS[:-6]} counter\n{HIT_TOKENS} {self.hit}\n"
            f"# TYPE {QUERY_TOKENS[:-6]} counter\n{QUERY_TOKENS} {self.query}\n"
        )

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        prompt = body["prompt"]
        if prompt[0] == FAIL_503:
            return JSONResponse({"error": {"message": "busy", "code": "service_unavailable"}}, 503)
        n = body["max_tokens"] - (prompt[0] == SHORT_OUTPUT)
        self.query += len(prompt)
        self.hit += len(prompt) // 2

        def event(payload: dict | str) -> str:
            return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

        def chunk(i: int, text: str, finish_reason: str | None) -> str:
            return event({"choices": [{"index": i, "text": text, "finish_reason": finish_reason}]})

        async def events() -> AsyncIterator[str]:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for i in range(n):
                    await asyncio.sleep(0.005)
                    if prompt[0] == FAIL_IN_STREAM and i == 1:
                        yield event({"error": {"message": "lost", "code": "request_aborted"}})
                        yield event("[DONE]")
                        return
                    yield chunk(0, f"t{i}", None)
                yield chunk(0, "", "length")
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n,
                    "total_tokens": len(prompt) + n,
                    "prompt_tokens_details": {"cached_tokens": len(prompt) // 2},
                }
                yield event({"choices": [], "usage": usage})
                yield event("[DONE]")
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[StubServer, str]]:
    stub = StubServer()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(stub.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.01)
    yield stub, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def workload(prompts: list[list[int]], output_len: int = 4) -> list[BenchRequest]:
    return [BenchRequest(p, output_len) for p in prompts]


def test_a_run_times_every_request_and_reads_usage_and_the_cache_hit_rate(
    stub: tuple[StubServer, str],
):
    server, url = stub
    requests = workload([[100 + i] * (10 + i) for i in range(6)])
    result = asyncio.run(
        client.run(
            url,
            requests,
            [r.prompt for r in requests],
            concurrency=2,
            metrics_urls=[f"{url}/nowhere", f"{url}/metrics"],
            warmup=[[200] * 7],
        )
    )
    assert [r.error for r in result.results] == [None] * 6
    for request, r in zip(requests, result.results):
        assert r.prompt_len == len(request.prompt) and r.output_len == 4
        assert r.cached_tokens == len(request.prompt) // 2
        assert 0 < r.ttft <= r.latency and len(r.itls) == 3
    assert result.radix_hit_rate == pytest.approx(
        sum(len(p) // 2 for p in (r.prompt for r in requests))
        / sum(len(r.prompt) for r in requests)
    )
    assert server.max_in_flight <= 2
    body = server.bodies[-1]
    assert (
        body["model"] == "stub-model" and body["ignore_eos"] is True and body["temperature"] == 0.0
    )
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_failures_are_reported_by_kind_and_never_raise(stub: tuple[StubServer, str]):
    _, url = stub
    requests = workload([[FAIL_503, 5], [FAIL_IN_STREAM, 5], [SHORT_OUTPUT, 5], [100, 5]])
    result = asyncio.run(
        client.run(url, requests, [r.prompt for r in requests], concurrency=4, metrics_urls=())
    )
    assert [r.error for r in result.results] == [
        "http_503",
        "stream_error:request_aborted",
        "wrong_output_len",
        None,
    ]
    assert result.radix_hit_rate is None  # no metrics URL given


def test_metrics_urls_are_discovered_from_server_info(stub: tuple[StubServer, str]):
    server, url = stub

    async def discover() -> list[str]:
        async with client.new_http_client(1, 5.0) as http:
            return await client.discover_metrics_urls(http, url)

    assert asyncio.run(discover()) == [f"{url}/metrics"]
    server.worker_metrics_port = 31001
    assert asyncio.run(discover()) == ["http://127.0.0.1:31001/metrics", f"{url}/metrics"]


def test_a_server_that_is_not_there_is_a_transport_error():
    port = free_port()

    async def send() -> RequestResult:
        async with client.new_http_client(1, 5.0) as http:
            return await client.stream_completion(
                http,
                f"http://127.0.0.1:{port}/v1/completions",
                client.completion_payload("m", [1], 2),
                1,
            )

    assert asyncio.run(send()).error == "transport:ConnectError"


def test_a_failed_warmup_stops_the_run(stub: tuple[StubServer, str]):
    _, url = stub
    with pytest.raises(RuntimeError, match="warm-up"):
        asyncio.run(client.run(url, workload([[100]]), [[100]], warmup=[[FAIL_503]]))


def test_arrival_times_are_seeded_poisson_or_all_at_once():
    assert client.arrival_times(3, None, 0) == [0.0, 0.0, 0.0]
    times = client.arrival_times(2000, 4.0, seed=7)
    assert (
        times == client.arrival_times(2000, 4.0, seed=7) != client.arrival_times(2000, 4.0, seed=8)
    )
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(1 / 4.0, rel=0.1)


def test_dispatch_keeps_the_cap_and_sends_a_turn_only_after_the_previous_one():
    requests = [
        BenchRequest([1], 1),
        BenchRequest([2], 1),
        BenchRequest([3], 1),
        BenchRequest([1, 9], 1, after=0),
        BenchRequest([2, 9], 1, after=1),
        BenchRequest([1, 9, 9], 1, after=3),
    ]
    log: list[tuple[str, int]] = []
    in_flight = peak = 0

    async def send(i: int) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        log.append(("start", i))
        for _ in range(
            3 - i % 3
        ):  # uneven durations, so completion order differs from sending order
            await asyncio.sleep(0)
        log.append(("end", i))
        in_flight -= 1
        return RequestResult(prompt_len=i)

    results = asyncio.run(client.dispatch(requests, send, concurrency=2))
    assert [r.prompt_len for r in results] == list(range(6))  # in workload order
    assert peak == 2
    for i, request in enumerate(requests):
        if request.after is not None:
            assert log.index(("end", request.after)) < log.index(("start", i))
