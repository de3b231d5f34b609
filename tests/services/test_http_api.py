"""The HTTP API against the three real processes on free ports: the official `openai`
client, SGLang's native endpoints, the bad-input table, concurrency, and disconnects that
must give back their KV. One server (tiny random-weight model) serves the whole module."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from engine.api import Engine
from services.tokenizer.chat_template import render_chat
from services.tokenizer.protocol.chat import ChatCompletionMessageParam
from testing.launcher import ServiceLauncher, cpu_flags
from testing.models import TINY_LLAMA_CONTEXT
from testing.net import all_kv_free, server_info, wait_until

API_KEY = "test-key"
MODEL = "tiny-llama"
MAX_TOTAL_TOKENS = 4096
USER = [{"role": "user", "content": "Tell me a story about a cat."}]
LONG = {"max_tokens": 3000, "ignore_eos": True}
"""Runs long enough to act on it mid-stream."""


@pytest.fixture(scope="session")
def base_url(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("http-api-logs"))
    with launcher.serve(
        [
            *cpu_flags(MAX_TOTAL_TOKENS, tiny_llama_dir),
            "--api-key",
            API_KEY,
            "--served-model-name",
            MODEL,
        ]
    ) as url:
        yield url


@pytest.fixture(scope="session")
def http(base_url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="session")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0)


# ----- health, auth, info ---------------------------------------------------------------------


def test_probes_need_no_key_and_the_api_does(base_url: str, http: httpx2.Client):
    assert httpx2.get(base_url + "/health").status_code == 200
    assert httpx2.get(base_url + "/healthz").status_code == 200
    assert httpx2.get(base_url + "/health_generate", timeout=30).status_code == 200
    denied = httpx2.get(base_url + "/v1/models")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == TINY_LLAMA_CONTEXT


def test_model_and_server_info(http: httpx2.Client, tiny_llama_dir: Path):
    model = http.get("/get_model_info").json()
    assert (
        model["model_path"] == str(tiny_llama_dir) and model["context_length"] == TINY_LLAMA_CONTEXT
    )
    info = server_info(http)
    assert info["max_total_tokens"] == MAX_TOTAL_TOKENS and "api_key" not in info


# ----- the openai client ----------------------------------------------------------------------


def test_greedy_chat_equals_the_offline_engine(client: openai.OpenAI, offline: Engine, tokenizer):
    response = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=16, extra_body={"ignore_eos": True}
    )
    input_ids = render_chat(tokenizer, [ChatCompletionMessageParam(**m) for m in USER]).ids
    expected = offline.generate(
        input_ids, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    )[0]
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(input_ids), 16)
    assert response.usage.total_tokens == len(input_ids) + 16


def test_chat_stream_equals_the_non_streamed_answer(client: openai.OpenAI):
    options = {
        "model": MODEL,
        "messages": USER,
        "temperature": 0,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**options)
    chunks = list(
        client.chat.completions.create(
            **options, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    # The same prompt again is served from the radix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completion_stream_and_usage(client: openai.OpenAI):
    options = {
        "model": MODEL,
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 10,
    }
    whole = client.completions.create(**options, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **options,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert whole.usage.completion_tokens == 10 and chunks[-1].usage.completion_tokens == 10
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0


def test_n_samples_each_prompt(client: openai.OpenAI):
    response = client.completions.create(
        model=MODEL,
        prompt=["Once upon a time", "In a galaxy"],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 24
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=2,
        max_tokens=5,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI):
    options = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 24,
        "extra_body": {"ignore_eos": True},
    }
    text = client.completions.create(**options).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    choice = client.completions.create(**options, stop=[stop]).choices[0]
    assert choice.text == text[: text.index(stop)] and choice.finish_reason == "stop"


def test_native_generate_single_and_batch(http: httpx2.Client):
    params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    one = http.post("/generate", json={"text": "Hello", "sampling_params": params}).json()
    assert len(one["output_ids"]) == 5 and one["meta_info"]["finish_reason"]["type"] == "length"
    batch = http.post(
        "/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": params}
    ).json()
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [3, 2]


def test_native_generate_honours_a_json_schema_object_and_a_regex(http: httpx2.Client):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    params = {"max_new_tokens": 32, "temperature": 0, "json_schema": schema}
    result = http.post("/generate", json={"text": "Answer:", "sampling_params": params}).json()
    assert json.loads(result["text"])["answer"] in ("yes", "no")
    assert result["meta_info"]["finish_reason"]["type"] == "stop"
    params = {"max_new_tokens": 16, "temperature": 0, "regex": "(red|green|blue)"}
    result = http.post("/generate", json={"text": "Color:", "sampling_params": params}).json()
    assert re.fullmatch("(red|green|blue)", result["text"])


def test_32_concurrent_streams_all_complete(base_url: str):
    async def run() -> list[str | None]:
        async with openai.AsyncOpenAI(
            base_url=base_url + "/v1", api_key=API_KEY, max_retries=0
        ) as aclient:

            async def one(i: int) -> str | None:
                stream = await aclient.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Count to {i}"}],
                    max_tokens=8,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
                return reasons[-1]

            return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(run()) == ["length"] * 32


# ----- disconnects, abort, flush --------------------------------------------------------------


def test_client_that_disconnects_mid_stream_frees_its_kv(http: httpx2.Client):
    with http.stream(
        "POST", "/v1/chat/completions", json={"messages": USER, "stream": True, **LONG}
    ) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = http.post("/flush_cache")
        assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
    wait_until(lambda: all_kv_free(http), 10, "the KV of the disconnected stream to be freed")


def test_client_that_disconnects_while_waiting_frees_its_kv(http: httpx2.Client):
    with pytest.raises(httpx2.ReadTimeout):
        http.post("/v1/completions", json={"prompt": "Hello", **LONG}, timeout=1.0)
    # 30 s: the abort lands at the worker's next turn, which on a loaded 2-core machine
    # (the whole suite beside it) has taken over 10 s; a leak never frees at all
    wait_until(lambda: all_kv_free(http), 30, "the KV of the disconnected request to be freed")


def test_flush_cache_when_idle(http: httpx2.Client):
    wait_until(lambda: all_kv_free(http), 10, "an idle server")
    assert http.post("/flush_cache").status_code == 200
    assert server_info(http)["available_kv_tokens"] == MAX_TOTAL_TOKENS


# ----- bad input ------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOO_LONG_PROMPT = [1] * (TINY_LLAMA_CONTEXT + 8)
BAD_INPUT = [
    ("malformed-json", CHAT, '{"messages": [', 400),
    ("wrong-content-type", CHAT, ("text/plain", json.dumps({"messages": USER})), 415),
    ("missing-messages", CHAT, {}, 400),
    ("empty-messages", CHAT, {"messages": []}, 400),
    ("missing-prompt", COMPLETIONS, {}, 400),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400),
    ("empty-prompt-list", COMPLETIONS, {"prompt": []}, 400),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": USER}, 404),
    ("temperature-as-string", CHAT, {"messages": USER, "temperature": "hot"}, 400),
    ("n-as-string", COMPLETIONS, {"prompt": "hi", "n": "2"}, 400),
    ("messages-not-a-list", CHAT, {"messages": "hi"}, 400),
    ("max-tokens-zero", CHAT, {"messages": USER, "max_tokens": 0}, 400),
    ("max-tokens-negative", COMPLETIONS, {"prompt": "hi", "max_tokens": -5}, 400),
    ("max-tokens-beyond-context", CHAT, {"messages": USER, "max_tokens": 10**6}, 400),
    ("prompt-longer-than-context", COMPLETIONS, {"prompt": TOO_LONG_PROMPT}, 400),
    ("temperature-negative", CHAT, {"messages": USER, "temperature": -0.5}, 400),
    ("top-p-zero", CHAT, {"messages": USER, "top_p": 0}, 400),
    ("top-p-above-one", COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400),
    ("n-zero", CHAT, {"messages": USER, "n": 0}, 400),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("logit-bias-id-out-of-vocab", CHAT, {"messages": USER, "logit_bias": {"99999999": 5}}, 400),
    ("logit-bias-id-not-a-number", COMPLETIONS, {"prompt": "hi", "logit_bias": {"abc": 5}}, 400),
    ("oversize-body", COMPLETIONS, {"prompt": "x" * (17 * 2**20)}, 413),
]


@pytest.mark.parametrize(
    ("path", "body", "status"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input_gets_an_openai_error(http: httpx2.Client, path: str, body: Any, status: int):
    if isinstance(body, dict):
        response = http.post(path, json=body)
    else:
        content_type, content = body if isinstance(body, tuple) else ("application/json", body)
        response = http.post(path, content=content, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text


def test_server_keeps_serving_after_bad_input(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1)
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4)
    assert response.choices[0].finish_reason in ("length", "stop")


def test_metrics_count_requests_by_endpoint_and_outcome_without_a_key(
    base_url: str, http: httpx2.Client
):
    def count(endpoint: str, outcome: str) -> float:
        text = httpx2.get(base_url + "/metrics").text
        labels = rf'[^}}]*endpoint="{re.escape(endpoint)}"[^}}]*outcome="{outcome}"[^}}]*'
        pattern = rf"radixserve_requests_total{{{labels}}} (\S+)"
        match = re.search(pattern, text)
        return float(match[1]) if match else 0.0

    assert httpx2.get(base_url + "/metrics").status_code == 200
    ok, bad = count("/v1/completions", "success"), count("/v1/completions", "client_error")
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}).status_code == 400
    assert count("/v1/completions", "success") == ok + 1
    assert count("/v1/completions", "client_error") == bad + 1


# ----- tokenizer endpoints, echo, the Responses API ---------------------------------------------

SURFACE_BAD_INPUT = [
    # (id, path, body, status, param)
    ("tokenize without a prompt", "/tokenize", {}, 400, "prompt"),
    ("tokenize another model", "/v1/tokenize", {"model": "x", "prompt": "a"}, 404, "model"),
    ("tokenize a bad message", "/tokenize", {"messages": [{"role": "x"}]}, 400, "messages[0].role"),
    ("detokenize an id outside the vocabulary", "/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("detokenize text", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    (
        "responses with previous_response_id",
        "/v1/responses",
        {"input": "hi", "previous_response_id": "resp_1"},
        400,
        "previous_response_id",
    ),
    (
        "responses with a built-in tool",
        "/v1/responses",
        {"input": "hi", "tools": [{"type": "web_search"}]},
        400,
        "tools[0].type",
    ),
    (
        "responses in the background",
        "/v1/responses",
        {"input": "hi", "background": True},
        400,
        "background",
    ),
    (
        "responses max_output_tokens beyond the context",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 10**6},
        400,
        "max_output_tokens",
    ),
    (
        "chat tool_choice naming no tool",
        CHAT,
        {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        400,
        "tool_choice",
    ),
    (
        "completions echo n 2 with logprobs",
        COMPLETIONS,
        {"prompt": "hi", "echo": True, "logprobs": 0, "n": 2},
        400,
        "n",
    ),
    (
        "chat field not served",
        CHAT,
        {"messages": USER, "prediction": {"type": "content"}},
        400,
        "prediction",
    ),
    # The render endpoints refuse what generation refuses, under the same names.
    ("completions render without a prompt", COMPLETIONS + "/render", {}, 400, "prompt"),
    (
        "completions render an id outside the vocabulary",
        COMPLETIONS + "/render",
        {"prompt": [10**9]},
        400,
        "prompt",
    ),
    (
        "completions render max_tokens beyond the context",
        COMPLETIONS + "/render",
        {"prompt": "hi", "max_tokens": 10**6},
        400,
        "max_tokens",
    ),
    (
        "chat render a bad role",
        CHAT + "/render",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    (
        "chat render tool_choice naming no tool",
        CHAT + "/render",
        {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
        400,
        "tool_choice",
    ),
    (
        "chat render temperature out of range",
        CHAT + "/render",
        {"messages": USER, "temperature": -1},
        400,
        "temperature",
    ),
    ("chat render another model", CHAT + "/render", {"model": "x", "messages": USER}, 404, "model"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [c[1:] for c in SURFACE_BAD_INPUT],
    ids=[c[0] for c in SURFACE_BAD_INPUT],
)
def test_bad_input_to_the_new_surface_names_the_field(
    http: httpx2.Client, path: str, body: Any, status: int, param: str
):
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert http.post("/tokenize", json={"prompt": "still serving"}).status_code == 200


def test_tokenize_gives_the_ids_chat_and_completions_send(http: httpx2.Client):
    chat = http.post("/tokenize", json={"messages": USER}).json()
    answer = http.post(CHAT, json={"messages": USER, "max_tokens": 1}).json()
    assert chat["count"] == len(chat["tokens"]) == answer["usage"]["prompt_tokens"]
    assert chat["max_model_len"] > chat["count"]
    text = http.post("/v1/tokenize", json={"prompt": "a cat", "return_token_strs": True}).json()
    completion = http.post(COMPLETIONS, json={"prompt": text["tokens"], "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == text["count"] == len(text["token_strs"])
    assert http.post("/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "a cat"}
    info = http.get("/tokenizer_info").json()
    assert info["chat_template"] and info["eos_token"] and info["model_max_length"] > 0


def test_model_card_by_id(http: httpx2.Client):
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    missing = http.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_echo_returns_the_prompt_and_its_logprobs_as_generate_does(http: httpx2.Client):
    """lm-eval's loglikelihood request: the prompt's token logprobs (first null), then the
    generated token's, equal to the native API's `input_token_logprobs`."""
    ids = http.post("/tokenize", json={"prompt": "The cat sat on the mat"}).json()["tokens"]
    body = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    choice = http.post(COMPLETIONS, json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    native = http.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 0},
        },
    ).json()["meta_info"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    prompt_values = [v for v, _, _ in native["input_token_logprobs"]]
    assert logprobs["token_logprobs"][: len(ids)] == pytest.approx(prompt_values, abs=1e-5)
    assert "".join(logprobs["tokens"][: len(ids)]) == "The cat sat on the mat"
    assert choice["text"].startswith("The cat sat on the mat")
    zero = http.post(COMPLETIONS, json={**body, "max_tokens": 0}).json()["choices"][0]
    assert zero["text"] == "The cat sat on the mat" and zero["finish_reason"] == "length"
    assert zero["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][: len(ids)]
    vllm = http.post(COMPLETIONS, json={"prompt": [ids], "prompt_logprobs": 0, "max_tokens": 1})
    entries = vllm.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    assert [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])] == pytest.approx(
        prompt_values[1:], abs=1e-5
    )


def test_responses_api_answers_and_streams_the_same_text(client: openai.OpenAI):
    whole = client.responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0
    )
    assert whole.status == "incomplete" and whole.output_text
    with client.responses.stream(
        model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
