"""A prompt of many megabytes stalls nothing (issue 21, Deliver 3): while one is refused by
`--max-prompt-chars`, or tokenized under a raised limit (and refused for the context), the
tokenizer keeps answering `/healthz` and `/health`, declares no peer dead, and serves other
requests to completion; afterwards the KV pool is idle and whole.

One server (the tiny Llama with SmolLM2's tokenizer, heartbeats every 0.2 s, so that a loop
blocked for 0.6 s would already declare its peers dead) serves the module, with a prompt
limit between the two prompts' sizes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from services.tokenizer.server import MAX_REQUEST_BODY_BYTES
from testing.launcher import ServiceLauncher, cpu_flags
from testing.net import all_kv_free, server_info, wait_until

TOKENIZED_CHARS = 12 * 2**20
"""Under the limit: templated and tokenized (about 2.8 million tokens), then refused for
the model's context."""
REFUSED_CHARS = 15_000_000
"""Over the limit, still under the 16 MiB body limit: refused before tokenizing."""
PROMPT_LIMIT = 13_000_000
GOOD = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceLauncher]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("tokenizer-loop-logs"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def url(launcher: ServiceLauncher, tiny_llama_dir: Path) -> Iterator[str]:
    flags = [*cpu_flags(8192, tiny_llama_dir), "--max-prompt-chars", str(PROMPT_LIMIT)]
    with launcher.serve(flags) as url:
        yield url


def big_chat(chars: int) -> bytes:
    text = ("The quick brown fox jumps over the lazy dog. " * (chars // 45 + 1))[:chars]
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4})
    assert len(body) < MAX_REQUEST_BODY_BYTES
    return body.encode()


class Probes:
    """`/healthz` and `/health` probed back to back from a thread until `stop`."""

    def __init__(self, url: str):
        self.url = url
        self.statuses: list[tuple[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Probes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx2.Client(base_url=self.url, timeout=60) as client:
            while not self._stop.is_set():
                for path in ("/healthz", "/health"):
                    self.statuses.append((path, client.get(path).status_code))
                self._stop.wait(0.05)


def while_big_request(url: str, body: bytes) -> tuple[httpx2.Response, list[int], Probes]:
    """`body` posted to chat from a thread while the probes run and good chat requests are
    sent one after another until it is answered: its response, the good requests' statuses
    and the probes."""
    answer: list[httpx2.Response] = []

    def send() -> None:
        headers = {"content-type": "application/json"}
        answer.append(
            httpx2.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=300)
        )

    big = threading.Thread(target=send)
    good: list[int] = []
    with Probes(url) as probes, httpx2.Client(base_url=url, timeout=120) as client:
        big.start()
        while True:
            response = client.post("/v1/chat/completions", json=GOOD)
            good.append(response.status_code)
            assert response.status_code != 200 or response.json()["choices"][0]["finish_reason"]
            if not big.is_alive():
                break
        big.join()
    return answer[0], good, probes


def assert_nothing_stalled(launcher: ServiceLauncher, good: list[int], probes: Probes) -> None:
    assert good and set(good) == {200}, good
    assert probes.statuses and {s for _, s in probes.statuses} == {200}, probes.statuses
    log = launcher.log("tokenizer")
    assert "stopped responding" not in log and " dead (epoch" not in log


@pytest.mark.parametrize(
    ("chars", "code"),
    [(REFUSED_CHARS, "invalid_value"), (TOKENIZED_CHARS, "context_length_exceeded")],
    ids=["refused-by-the-limit", "tokenized"],
)
def test_a_huge_prompt_leaves_probes_peers_and_other_requests_unharmed(
    launcher: ServiceLauncher, url: str, chars: int, code: str
):
    response, good, probes = while_big_request(url, big_chat(chars))
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "messages" and error["code"] == code, error
    if chars > PROMPT_LIMIT:
        assert "--max-prompt-chars" in error["message"] and str(chars) in error["message"]
    assert_nothing_stalled(launcher, good, probes)


def test_the_server_still_serves_with_its_kv_pool_whole(url: str):
    with httpx2.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=GOOD)
        assert response.status_code == 200, response.text
        wait_until(lambda: all_kv_free(client), 30, "an idle worker with every KV slot free")
        assert server_info(client, check_integrity="true")["radix_integrity"] == "ok"
