"""`radixserve serve` as a user runs it, on the embedded model: one command brings up a
server whose greedy answers equal the offline Engine's, and the death of any one process
takes the whole group down with a non-zero status."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from engine.api import Engine
from testing.launcher import (
    SERVING_LINE,
    ServiceLauncher,
    cpu_flags,
    port_flags,
    server_ports,
    serving_url,
    start_serve,
)
from testing.net import free_port, free_ports, http_status, server_info, wait_until

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Longer than the other service tests' 0.2 s: the embedded model's prefill runs between
# heartbeats, and a busy CI machine must not make the worker look dead.
HEARTBEAT_INTERVAL = 1.0


@pytest.mark.timeout(240)
def test_serve_answers_like_the_engine_then_exits_non_zero_when_the_detokenizer_dies(
    tokenizer, tmp_path: Path
):
    # The offline reference first, so that it does not compete with the server for the CPU.
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    with Engine(dtype="float32", max_total_tokens=4096) as engine:
        offline = engine.generate(prompt_ids, {"temperature": 0, "max_new_tokens": 24})[0]

    ports = server_ports()
    flags = [  # no --model: the embedded SmolLM2-135M-Instruct
        *cpu_flags(max_total_tokens=4096),
        "--host",
        "127.0.0.1",
        "--heartbeat-interval",
        str(HEARTBEAT_INTERVAL),
        *port_flags(ports),
    ]
    log = tmp_path / "children.log"
    serve = start_serve(flags, log)
    try:
        pids, url = {}, None
        # The launcher prints the children's pids, then the URL when ready.
        for line in serve.stdout:
            if match := re.match(r"radixserve: started (\w+) \(pid (\d+)\)", line):
                pids[match[1]] = int(match[2])
            elif match := SERVING_LINE.match(line):
                url = match[1]
                break
        assert url == f"http://127.0.0.1:{ports['port']}/v1", log.read_text()
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="embedded", messages=MESSAGES, max_tokens=16, temperature=0
        )
        assert "Paris" in answer.choices[0].message.content

        served = client.completions.create(
            model="embedded", prompt=prompt_ids, max_tokens=24, temperature=0
        )
        assert served.choices[0].text == offline.text
        # The chat path renders the same ids.
        assert offline.text.startswith(answer.choices[0].message.content)

        # A stream in flight when the detokenizer dies fails with a clear error, not a hang.
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx2.stream("POST", url + "/chat/completions", json=body, timeout=10) as stream:
            events = (
                line[len("data: ") :] for line in stream.iter_lines() if line.startswith("data: ")
            )
            assert json.loads(next(events))["choices"]
            killed_at = time.monotonic()
            os.kill(pids["detokenizer"], signal.SIGKILL)
            rest = list(events)
        assert (
            rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "service_unavailable"
        )
        assert serve.wait(10) != 0
        assert time.monotonic() - killed_at < 10
        for role in ("worker", "tokenizer"):  # the survivors were stopped, not orphaned
            with pytest.raises(ProcessLookupError):
                os.kill(pids[role], 0)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(15)


DRAIN_STREAMS = 16
DRAIN_TOKENS = 192


def drain_stream(url: str, index: int, started: threading.Barrier, out: dict[int, object]) -> None:
    """One greedy stream with usage; waits at `started` once its first event is in."""
    body = {
        "prompt": f"Story {index}:",
        "max_tokens": DRAIN_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        with httpx2.stream("POST", url + "/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            events = [
                json.loads(line[len("data: ") :])
                for line in _after_first_event(response.iter_lines(), started)
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        out[index] = events
    except BaseException as e:  # reported by the test
        out[index] = e
        started.abort()


def _after_first_event(lines: Iterator[str], started: threading.Barrier) -> Iterator[str]:
    """`lines`, pausing at `started` after the first event: the test then knows that all
    streams are in flight."""
    waited = False
    for line in lines:
        yield line
        if not waited and line.startswith("data: "):
            started.wait(60)
            waited = True


@pytest.mark.timeout(240)
def test_sigterm_drains_16_streams_in_flight_to_their_full_output_then_exits_0(
    tiny_llama_dir: Path, tmp_path: Path
):
    ports = server_ports()
    flags = [*cpu_flags(8192, tiny_llama_dir), "--host", "127.0.0.1", *port_flags(ports)]
    serve = start_serve(flags, tmp_path / "children.log")
    try:
        url = next(m[1] for line in serve.stdout if (m := SERVING_LINE.match(line)))
        started = threading.Barrier(DRAIN_STREAMS + 1)
        out: dict[int, object] = {}
        threads = [
            threading.Thread(target=drain_stream, args=(url, i, started, out))
            for i in range(DRAIN_STREAMS)
        ]
        for thread in threads:
            thread.start()
        started.wait(120)  # every stream has its first event: all 16 are in flight
        serve.send_signal(signal.SIGTERM)
        # New requests are refused once the tokenizer stops listening, while the 16 go on.
        wait_until(
            lambda: http_status(url.removesuffix("/v1") + "/health") is None,
            30,
            "the API to stop accepting connections",
        )
        for thread in threads:
            thread.join(120)
        assert serve.wait(60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    for i in range(DRAIN_STREAMS):
        events = out[i]
        assert isinstance(events, list), events
        assert not any("error" in e for e in events), events[-1]
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"], finishes
        assert events[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS


# ----- side by side, and a start a person can follow -----------------------------------------

STARTUP_LINES = (
    r"worker \w+ engine\.kernels\.cpu\.build: CPU kernels(: \w+.* in \d+\.\d s| unavailable)",
    r"Loading weights: 100%",
    r"worker INFO engine\.model\.loader: weights: \d+ tensors, .* loaded in \d+\.\d s",
    r"worker INFO engine\.model\.runner: KV cache: 4096 tokens, .* sized in \d+\.\d s",
    r"worker INFO engine\.model\.runner: decode graphs: ",
    r"worker INFO services\.worker\.worker: engine ready in \d+\.\d s",
)
"""The worker's start-up phases, in order, each with its duration (a progress bar for the
weights); the tokenizer's own load is `TOKENIZER_LINE`."""
TOKENIZER_LINE = r"tokenizer INFO engine\.model\.tokenizer_cache: tokenizer: loaded in \d+\.\d s"


@pytest.mark.timeout(300)
def test_two_servers_with_default_flags_but_the_port_serve_side_by_side(
    tiny_llama_dir: Path, tmp_path: Path
):
    ports = free_ports(2)
    logs = [tmp_path / f"server-{port}.log" for port in ports]
    servers = [
        start_serve([*cpu_flags(4096, tiny_llama_dir), "--port", str(port)], log)
        for port, log in zip(ports, logs)
    ]
    infos = []
    try:
        for server, log, port in zip(servers, logs, ports):
            url = serving_url(server, log)
            assert url == f"http://127.0.0.1:{port}/v1"
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
            answer = client.completions.create(model=str(tiny_llama_dir), prompt="Hi", max_tokens=4)
            assert answer.usage.completion_tokens == 4
            with httpx2.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as http:
                info = server_info(http)
                # The API port's /metrics carries the worker's series: the tokenizer found
                # the metrics port the launcher chose for the worker.
                assert "radixserve_num_requests_running{" in http.get("/metrics").text
            for role in ("worker", "detokenizer"):
                healthz = f"http://127.0.0.1:{info[f'{role}_metrics_port']}/healthz"
                assert http_status(healthz) == 200
            infos.append(info)
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        codes = [server.wait(60) for server in servers]
    assert codes == [0, 0]
    assert infos[0]["worker_port"] is None and infos[0]["tokenizer_control_port"] is None
    for key in ("ipc_dir", "ipc_keys_dir", "launch_id", "worker_metrics_port"):
        assert infos[0][key] != infos[1][key], key
    assert not any(Path(info["ipc_dir"]).exists() for info in infos)  # removed at exit

    log = logs[0].read_text(errors="replace")
    found = [re.search(pattern, log) for pattern in STARTUP_LINES]
    assert all(found), [p for p, m in zip(STARTUP_LINES, found) if m is None]
    starts = [match.start() for match in found if match is not None]
    assert starts == sorted(starts), "start-up phases out of order"
    assert re.search(TOKENIZER_LINE, log)
    # The launcher's own /health probes, and every other probe, stay out of the access log.
    assert '"GET /health HTTP/1.1"' not in log and '"GET /metrics HTTP/1.1"' not in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log


@pytest.mark.timeout(180)
def test_log_probe_requests_brings_the_probes_back_into_the_access_log(
    tiny_llama_dir: Path, tmp_path: Path
):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    launcher = ServiceLauncher(tmp_path, heartbeat_interval=None, show_logs=False)
    flags = ["--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", str(port)]
    # The tokenizer alone: its ZMQ sockets in a directory of its own, no worker behind it.
    launcher.start("tokenizer", [*flags, "--ipc-dir", str(tmp_path), "--log-probe-requests"])
    try:
        wait_until(lambda: http_status(f"{url}/healthz") == 200, 120, "the tokenizer to listen")
        assert http_status(f"{url}/health") == 503  # no worker
        assert http_status(f"{url}/metrics") == 200
    finally:
        launcher.stop_all()
    log = launcher.log("tokenizer")
    for path, status in (("/healthz", 200), ("/health", 503), ("/metrics", 200)):
        assert f'"GET {path} HTTP/1.1" {status}' in log, log
