"""Long prompts dropped during their prefill cost no more than the turn in flight: the
embedded model served with its defaults (its dtype and the CPU's chunk size), four prompts
of several chunks each sent and then abandoned by their clients, and a one-token
completion right after answered within a few turns (as measured on one such prompt), with
the KV pool whole."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
import pytest

from testing.launcher import port_flags, server_ports, serving_url, start_serve
from testing.net import all_kv_free, server_info, wait_until

DROPPED = 4
CHUNKS_PER_PROMPT = 6
MAX_TOTAL_TOKENS = 32768
TURNS_TO_ANSWER = 4
"""The turn in flight when the clients leave, the one that reads their aborts, the
completion's own prefill, and one of slack."""
SLACK_S = 10.0
"""Process and HTTP overheads on a loaded two-core machine, beyond the turns."""


def _send_and_hold(url: str, body: dict[str, object]) -> socket.socket:
    """A raw HTTP request whose connection stays open until the caller closes it: a
    client that gives up waiting."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def prompt(length: int, seed: int) -> list[int]:
    """Token ids that share no prefix with another seed's."""
    return [100 + (7 * seed + 13 * j + 11) % 20000 for j in range(length)]


@pytest.mark.timeout(600)
def test_dropped_long_prompts_stop_costing_within_a_few_turns(tmp_path: Path):
    ports = server_ports()
    flags = [  # the embedded model, its dtype and its chunk size as a user gets them
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--host",
        "127.0.0.1",
        "--heartbeat-interval",
        "1.0",
        *port_flags(ports),
    ]
    log = tmp_path / "children.log"
    serve = start_serve(flags, log)
    try:
        url = serving_url(serve, log).removesuffix("/v1")
        with httpx2.Client(base_url=url, timeout=120) as http:
            info = server_info(http)
            chunk = info["chunked_prefill_size"]
            assert isinstance(chunk, int) and chunk > 0, info
            length = min(CHUNKS_PER_PROMPT * chunk, info["context_length"] // 2)
            started = time.monotonic()
            whole = http.post(
                "/v1/completions",
                json={"model": "embedded", "prompt": prompt(length, -1), "max_tokens": 1},
            )
            assert whole.status_code == 200, whole.text
            # Attention grows with the prefix: the last chunk costs at most twice the mean.
            turn_s = 2 * (time.monotonic() - started) / CHUNKS_PER_PROMPT
            clients = [
                _send_and_hold(
                    url,
                    {
                        "model": "embedded",
                        "prompt": prompt(length, i),
                        "max_tokens": 16,
                    },
                )
                for i in range(DROPPED)
            ]
            wait_until(lambda: server_info(http)["num_running_reqs"] > 0, 60, "a prefill under way")
            for client in clients:
                client.close()
            left = time.monotonic()
            answer = http.post(
                "/v1/completions",
                json={"model": "embedded", "prompt": "Hi", "max_tokens": 1, "temperature": 0},
            )
            answered = time.monotonic() - left
            assert answer.status_code == 200, answer.text
            bound = TURNS_TO_ANSWER * turn_s + SLACK_S
            assert answered < bound, (
                f"answered {answered:.1f} s after the drop; one turn is {turn_s:.2f} s"
            )
            wait_until(lambda: all_kv_free(http), bound, "the KV pool idle and whole")
            assert server_info(http, check_integrity="true")["radix_integrity"] == "ok"
            print(f"chunk {chunk}, turn {turn_s:.2f} s, answered {answered:.1f} s after the drop")
    finally:
        serve.terminate()
        serve.wait(60)
