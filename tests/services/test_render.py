"""vLLM's render endpoints against the three real processes: for each request, the ids
`/v1/completions/render` and `/v1/chat/completions/render` answer are the ids the
generation endpoints submit for the same request, and nothing reaches the worker.

Completions expose the ids they submitted (prompt logprobs carry each prompt token's id);
chat exposes only its prompt's length, so its ids are compared through the model: the
greedy logprobs of chat's answer equal those of `/generate` on the rendered ids, and moving
one prompt token moves them (the comparison can fail)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

from testing.models import TINY_LLAMA_CONTEXT
from tests.services.conftest import RouterFacingServer

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS_CAP = 4096
"""The server's default `--max-tokens-cap`."""
SYSTEM = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name a river in Egypt."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
VLLM_GENERATE_REQUEST_FIELDS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}


@pytest.fixture(scope="module")
def http(router_facing_server: RouterFacingServer) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=router_facing_server.url, timeout=60) as client:
        yield client


def render(http: httpx2.Client, path: str, body: dict[str, Any]) -> Any:
    response = http.post(path + "/render", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def generate_prompt_ids(http: httpx2.Client, prompt: dict[str, Any]) -> list[list[int]]:
    """The ids `/generate` submitted for `prompt` (text or input_ids), every position's id
    from its prompt logprobs."""
    answer = http.post(
        "/generate",
        json={
            **prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    ).json()
    answers = answer if isinstance(answer, list) else [answer]
    return [[t for _, t, _ in a["meta_info"]["input_token_logprobs"]] for a in answers]


def completion_prompt_ids(http: httpx2.Client, body: dict[str, Any]) -> list[list[int | None]]:
    """Per prompt, the ids `/v1/completions` submitted: each position's own id leads its
    `prompt_logprobs` entry; the first position has none (None)."""
    answer = http.post(COMPLETIONS, json={**body, "prompt_logprobs": 0, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return [
        [None if e is None else int(next(iter(e))) for e in choice["prompt_logprobs"]]
        for choice in answer.json()["choices"]
    ]


@pytest.mark.parametrize(
    "prompt",
    [
        "The cat sat on the mat",
        ["A first prompt", "and a second, longer prompt of the batch"],
    ],
    ids=["text", "batch-of-texts"],
)
def test_completions_render_gives_the_ids_completions_and_generate_submit(
    http: httpx2.Client, prompt: str | list[str]
):
    rendered = render(http, COMPLETIONS, {"prompt": prompt})
    ids = [r["token_ids"] for r in rendered]
    assert len(ids) == (1 if isinstance(prompt, str) else len(prompt))
    assert ids == generate_prompt_ids(http, {"text": prompt})
    assert [[None, *i[1:]] for i in ids] == completion_prompt_ids(http, {"prompt": prompt})


def test_a_token_id_prompt_renders_as_sent(http: httpx2.Client):
    ids = generate_prompt_ids(http, {"text": "Once upon a time"})[0]
    for prompt in (ids, [ids, ids[:2]]):
        rendered = [r["token_ids"] for r in render(http, COMPLETIONS, {"prompt": prompt})]
        assert rendered == generate_prompt_ids(http, {"input_ids": prompt})
        assert rendered == (prompt if isinstance(prompt[0], list) else [prompt])


def test_the_render_is_vllms_generate_request_with_the_servers_defaults_applied(
    http: httpx2.Client,
):
    body = {
        "model": None,
        "prompt": "Hello",
        "temperature": 0.5,
        "seed": 7,
        "stop": "\n",
        "logprobs": 2,
        "cache_salt": "tenant-a",
        "priority": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "regex": "[a-z]+",
    }
    (rendered,) = render(http, COMPLETIONS, body)
    assert set(rendered) == VLLM_GENERATE_REQUEST_FIELDS
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", rendered["request_id"])
    assert rendered["features"] is None and rendered["kv_transfer_params"] is None
    assert (rendered["cache_salt"], rendered["priority"], rendered["stream"]) == (
        "tenant-a",
        3,
        True,
    )
    assert rendered["stream_options"]["include_usage"] is True
    params = rendered["sampling_params"]
    room = TINY_LLAMA_CONTEXT - len(rendered["token_ids"])
    assert params["max_tokens"] == min(room, MAX_TOKENS_CAP)
    assert (params["temperature"], params["seed"], params["stop"]) == (0.5, 7, ["\n"])
    assert (params["logprobs"], params["prompt_logprobs"]) == (2, None)
    assert params["structured_outputs"] == {"regex": "[a-z]+"}
    chat = render(http, CHAT, {"messages": SYSTEM, "max_completion_tokens": 9})
    assert set(chat) == VLLM_GENERATE_REQUEST_FIELDS
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat["request_id"])
    assert chat["sampling_params"]["max_tokens"] == 9 and chat["stream_options"] is None


def greedy(http: httpx2.Client, path: str, body: dict[str, Any]) -> tuple[int, list[float]]:
    """(prompt tokens, logprobs of the 4 greedy output tokens) of one request."""
    options = {"temperature": 0, "ignore_eos": True}
    if path == CHAT:
        answer = http.post(CHAT, json={**body, **options, "max_tokens": 4, "logprobs": True})
        assert answer.status_code == 200, answer.text
        content = answer.json()["choices"][0]["logprobs"]["content"]
        return answer.json()["usage"]["prompt_tokens"], [t["logprob"] for t in content]
    sampling = {**options, "max_new_tokens": 4}
    meta = http.post(
        path, json={**body, "sampling_params": sampling, "return_logprob": True}
    ).json()["meta_info"]
    return meta["prompt_tokens"], [v for v, _, _ in meta["output_token_logprobs"]]


CHATS = {
    "system-message": {"messages": SYSTEM},
    "tools": {"messages": SYSTEM[1:], "tools": TOOLS},
    "no-generation-prompt": {"messages": SYSTEM, "add_generation_prompt": False},
    "continue-final-message": {
        "messages": [*SYSTEM, {"role": "assistant", "content": "The Nile is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
}


@pytest.mark.parametrize("body", CHATS.values(), ids=CHATS.keys())
def test_chat_render_gives_the_ids_chat_submits(http: httpx2.Client, body: dict[str, Any]):
    ids = render(http, CHAT, body)["token_ids"]
    count, logprobs = greedy(http, CHAT, body)
    assert count == len(ids)
    assert greedy(http, "/generate", {"input_ids": ids}) == (
        count,
        pytest.approx(logprobs, abs=1e-4),
    )
    moved = [*ids[: len(ids) // 2], (ids[len(ids) // 2] + 1) % 1000, *ids[len(ids) // 2 + 1 :]]
    _, other = greedy(http, "/generate", {"input_ids": moved})
    assert max(abs(a - b) for a, b in zip(other, logprobs)) > 1e-3, "the comparison cannot fail"


def test_chat_render_applies_the_template_flags_and_tool_choice_as_chat_does(
    http: httpx2.Client,
):
    opened = render(http, CHAT, {"messages": SYSTEM})["token_ids"]
    closed = render(http, CHAT, {"messages": SYSTEM, "add_generation_prompt": False})["token_ids"]
    assert len(closed) < len(opened) and opened[: len(closed)] == closed
    with_tools = render(http, CHAT, {"messages": SYSTEM, "tools": TOOLS})["token_ids"]
    no_tools = render(http, CHAT, {"messages": SYSTEM, "tools": TOOLS, "tool_choice": "none"})
    assert with_tools != opened and no_tools["token_ids"] == opened
    forced = render(http, CHAT, {"messages": SYSTEM, "tools": TOOLS, "tool_choice": "required"})
    assert forced["token_ids"] == with_tools
    assert "json" in forced["sampling_params"]["structured_outputs"]


def worker_query_tokens(http: httpx2.Client) -> float:
    text = http.get("/metrics").text
    match = re.search(r"^radixserve_prefix_cache_query_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    assert match, "the API port's /metrics carries the worker's series"
    return float(match[1])


def settled_query_tokens(http: httpx2.Client) -> float:
    """The worker's prompt-token counter once the earlier requests are all in it (the worker
    copies its counters every 0.25 s)."""
    previous = None
    while (value := worker_query_tokens(http)) != previous:
        previous = value
        time.sleep(0.6)
    return value


def test_a_render_sends_nothing_to_the_worker(http: httpx2.Client):
    before = settled_query_tokens(http)
    render(http, COMPLETIONS, {"prompt": ["a prompt"] * 8})
    render(http, CHAT, {"messages": SYSTEM, "n": 4})
    assert settled_query_tokens(http) == before
    http.post(COMPLETIONS, json={"prompt": "one real request", "max_tokens": 1})
    assert settled_query_tokens(http) > before
