"""`radixserve serve --tp-size 2` on the tiny Llama: the worker runs rank 0 and spawns rank
1; the server answers as the offline Engine at tp_size=1 does, and the death of rank 1
takes the worker, and with it the whole server, down with a log line naming the rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest

from engine.api import Engine
from testing.launcher import (
    SERVING_LINE,
    cpu_flags,
    port_flags,
    server_ports,
    start_serve,
)
from testing.net import wait_until

MESSAGES = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 12
MAX_TOTAL_TOKENS = 2048
HEARTBEAT_INTERVAL = 1.0
"""As test_serve's: two ranks' start-up on two cores must not look like a death."""


@dataclass
class TPServer:
    serve: subprocess.Popen[str]
    url: str
    log: Path

    def rank_pid(self, rank: int) -> int:
        match = re.search(
            rf"started tensor-parallel rank {rank} \(pid (\d+)\)", self.log.read_text()
        )
        assert match, self.log.read_text()
        return int(match[1])


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, tokenizer) -> tuple[list[int], str]:
    """The chat prompt's ids and the offline Engine's greedy text at tp_size=1 (first, so
    that it does not compete with the server for the CPU)."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    options = dict(dtype="float32", device="cpu", max_total_tokens=MAX_TOTAL_TOKENS)
    with Engine(str(tiny_llama_dir), **options) as engine:
        params = {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
        return prompt_ids, engine.generate(prompt_ids, params)[0].text


@pytest.fixture(scope="module")
def server(
    reference: tuple[list[int], str], tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TPServer]:
    ports = server_ports()
    flags = [
        *cpu_flags(MAX_TOTAL_TOKENS, tiny_llama_dir),
        "--tp-size",
        "2",
        "--host",
        "127.0.0.1",
        "--heartbeat-interval",
        str(HEARTBEAT_INTERVAL),
        *port_flags(ports),
    ]
    log = tmp_path_factory.mktemp("tp-server") / "children.log"
    serve = start_serve(flags, log)
    try:
        assert serve.stdout is not None
        url = None
        for line in serve.stdout:  # the launcher prints the URL once /health answers
            if match := SERVING_LINE.match(line):
                url = match[1]
                break
        assert url, log.read_text()
        yield TPServer(serve, url, log)
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)


@pytest.mark.timeout(240)
def test_tp2_server_answers_as_tp1_and_keeps_its_kv_whole(
    server: TPServer, reference: tuple[list[int], str], tiny_llama_dir: Path
):
    prompt_ids, offline_text = reference
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    model = str(tiny_llama_dir)
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(model=model, messages=MESSAGES, **greedy)
    assert answer.choices[0].message.content == offline_text
    served = client.completions.create(model=model, prompt=prompt_ids, **greedy)
    assert served.choices[0].text == offline_text

    # Refused by the worker (it alone knows the pool), and the server serves on.
    too_long = httpx2.post(
        f"{server.url}/completions",
        json={"model": model, "prompt": [5] * 100, "max_tokens": MAX_TOTAL_TOKENS},
        timeout=30,
    )
    assert too_long.status_code == 400, too_long.text
    assert "KV cache holds" in too_long.json()["error"]["message"]
    again = client.completions.create(model=model, prompt=prompt_ids, **greedy)
    assert again.choices[0].text == offline_text

    base = server.url.removesuffix("/v1")
    info = httpx2.get(f"{base}/get_server_info", params={"check_integrity": "true"}).json()
    assert info["tp_size"] == 2
    assert info["num_running_reqs"] == 0 and info["radix_integrity"] == "ok"
    assert info["available_kv_tokens"] + info["evictable_kv_tokens"] == info["max_total_tokens"]


@pytest.mark.timeout(120)
def test_killing_rank_1_ends_the_worker_and_the_server_naming_the_rank(server: TPServer):
    os.kill(server.rank_pid(1), signal.SIGKILL)
    wait_until(lambda: server.serve.poll() is not None, 10, "radixserve serve to exit")
    assert server.serve.returncode != 0
    log = server.log.read_text()
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) exited with signal SIGKILL", log), log
    assert "the worker process exited with status 4" in log, log
