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

from benchmarks.support.launcher import (
    SERVING_LINE,
    cpu_flags,
    port_flags,
    server_ports,
    start_serve,
)
from benchmarks.support.net import http_status, wait_until
from engine.api import Engine

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
