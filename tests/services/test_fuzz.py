"""The HTTP API fuzzed against the three real processes: hypothesis builds request bodies
for every endpoint from the fields each one knows, with each field either a good value or
junk (wrong types, huge numbers, unicode, nested junk), plus unknown fields, bad JSON and
bad headers. Whatever comes in, the server answers within the client's timeout, never with
a 5xx, never with a stack trace, always in the shape the endpoint promises; and it still
serves afterwards with every KV slot back.

The field lists below are taken from `services/tokenizer/protocol.py` and
`SamplingParams`, and mix junk into the values; schemathesis fuzzes the valid side from the
OpenAPI document (`benchmarks/api_fuzz.py`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling.sampling_params import SamplingParams
from testing.launcher import ServiceLauncher, cpu_flags
from testing.net import assert_idle_and_whole
from tests.services.conftest import strict_json

API_KEY = "fuzz-key"
MAX_TOKENS_CAP = 8
"""Valid requests generate a few tokens at most, so a thousand of them take seconds."""
BATCHES = 40
BATCH_SIZE = 25
"""40 hypothesis examples of 25 concurrent requests: 1,000 requests."""
CLIENT_TIMEOUT_S = 60.0
"""A request unanswered this long is a hang."""

# ----- strategies -------------------------------------------------------------------------------

TEXT = st.text(max_size=40) | st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "\ufffd",
        "🦄" * 20,
        "\u202e\u2066",
        "ß" * 300,
        "a" * 3000,
        "{{ raise('x') }}",
        "<|im_end|>",
        "%s%n%x",
        "\\u0000",
        "null",
        "NaN",
    ]
)
NUMBER = (
    st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(
        [
            0,
            -1,
            1,
            2,
            2**31,
            2**63 - 1,
            2**63,
            2**64,
            -(2**63) - 1,
            10**40,
            1e308,
            -1e308,
            5e-324,
            0.5,
            1.0000001,
        ]
    )
)
SCALAR = st.none() | st.booleans() | NUMBER | TEXT
JUNK = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
TOKEN_IDS = st.lists(
    st.integers(min_value=-5, max_value=60_000) | st.sampled_from([0, 1, 2, 49151, 49152]),
    max_size=20,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | JUNK},
    optional={
        "content": TEXT
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3)
        | JUNK,
        "name": JUNK,
    },
)
SCHEMA = (
    st.sampled_from(
        [
            {"type": "object"},
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"enum": ["yes", "no"]},
            {"type": "string", "maxLength": 3},
            {"type": "array", "items": {"type": "boolean"}},
            {"type": "nonsense"},
            {"$ref": "#/nowhere"},
            {"anyOf": []},
        ]
    )
    | JUNK
)
RESPONSE_FORMAT = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema"]) | JUNK},
    optional={
        "json_schema": st.fixed_dictionaries({"name": TEXT}, optional={"schema": SCHEMA}) | JUNK
    },
)
HUGE = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30])


def ints(low: int, high: int) -> st.SearchStrategy:
    """The field's range and just past it, plus integers no 64-bit field holds."""
    in_range = st.integers(low, high)
    return st.one_of(in_range, in_range, in_range, HUGE)


REGEX = (
    st.sampled_from(["[a-z]+", "(yes|no)", "\\d{3}", "a*", "(", "[", "\\", "x{99999}", ".*"]) | TEXT
)


REQUIRED = {"messages", "prompt", "text"}


@st.composite
def body(draw: st.DrawFn, known: dict[str, st.SearchStrategy]) -> dict[str, Any]:
    """A subset of the known fields (the prompt usually among them) with plausible values;
    in a third of the bodies some fields hold junk instead, and some bodies carry unknown fields.
    Few fields per body, so that many bodies are valid and reach the worker."""
    required = {
        name: known[name]
        for name in REQUIRED & set(known)
        if draw(st.sampled_from([True] * 9 + [False]))
    }
    if "input_ids" in known and "text" in required and draw(st.booleans()):
        required = {"input_ids": known["input_ids"]}
    optional = sorted(name for name in known if name not in required)
    names = draw(
        st.lists(
            st.sampled_from(optional), max_size=draw(st.sampled_from([2, 4, 4, 8])), unique=True
        )
    )
    chosen = {name: draw(known[name]) for name in [*required, *names]}
    if "stream" in known and draw(st.sampled_from([False, False, True])):
        chosen["stream"] = True
    if chosen and draw(st.sampled_from([False, False, True])):
        for name in draw(
            st.lists(st.sampled_from(sorted(chosen)), min_size=1, max_size=3, unique=True)
        ):
            chosen[name] = draw(JUNK)
    if draw(st.sampled_from([False] * 4 + [True])):
        chosen = {**draw(st.dictionaries(TEXT, JUNK, min_size=1, max_size=2)), **chosen}
    return chosen


SAMPLING = {  # the fields chat and completions share (protocol.SamplingRequest)
    "model": st.just("fuzz-model") | TEXT,
    "max_tokens": ints(-2, 20),
    "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5),
    "n": ints(-1, 4),
    "stop": TEXT | st.lists(TEXT, max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "seed": ints(-1, 2**64),
    "logit_bias": st.dictionaries(st.integers(-1, 50_000).map(str) | TEXT, NUMBER, max_size=3),
    "response_format": RESPONSE_FORMAT,
    "regex": REGEX,
    "ebnf": st.sampled_from(['root ::= "a" | "b"', "root ::=", "nonsense"]) | TEXT,
    "top_k": ints(-2, 100),
    "min_p": st.floats(-1, 2),
    "repetition_penalty": st.floats(-1, 3),
    "min_tokens": ints(-1, 20),
    "ignore_eos": st.booleans(),
    "stop_token_ids": TOKEN_IDS,
    "skip_special_tokens": st.booleans(),
    "cache_salt": TEXT,
    "priority": ints(-10, 10),
}
CHAT = {
    **SAMPLING,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_completion_tokens": ints(-1, 20),
    "logprobs": st.booleans(),
    "top_logprobs": ints(-1, 30),
}
COMPLETION = {
    **SAMPLING,
    "prompt": TEXT | st.lists(TEXT, max_size=3) | TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3),
    "logprobs": ints(-1, 30),
}
NATIVE_SAMPLING = {f.name: SCALAR for f in fields(SamplingParams)} | {
    "max_new_tokens": ints(-1, 20),
    "temperature": st.floats(-1, 3),
    "json_schema": SCHEMA | SCHEMA.map(json.dumps),
    "regex": REGEX,
    "n": ints(-1, 3),
}
GENERATE = {
    "text": TEXT | st.lists(TEXT, max_size=3),
    "input_ids": TOKEN_IDS | st.lists(TOKEN_IDS, max_size=3),
    "sampling_params": body(NATIVE_SAMPLING),
    "stream": st.booleans(),
    "return_logprob": st.booleans(),
    "top_logprobs_num": ints(-1, 10),
}
ABORT = {"rid": TEXT, "abort_all": st.just(False)}
"""Not `abort_all: true`: it would abort the concurrent fuzz requests (they would get the
error of an aborted request, which is not what is fuzzed here)."""


POSTS = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": COMPLETION,
    "/generate": GENERATE,
    "/abort_request": ABORT,
}
GETS = [
    "/v1/models",
    "/health",
    "/healthz",
    "/get_model_info",
    "/get_server_info",
    "/metrics",
    "/v1/nothing",
    "/",
]


@st.composite
def request(draw: st.DrawFn) -> dict[str, Any]:
    """One HTTP request as httpx keyword arguments, plus the path."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    kind = draw(st.sampled_from(["body"] * 12 + ["raw", "get", "auth", "method"]))
    if kind == "get":
        return {
            "method": "GET",
            "url": draw(st.sampled_from(GETS)),
            "headers": headers,
            "params": draw(
                st.dictionaries(st.sampled_from(["check_integrity", "x"]), TEXT, max_size=1)
            ),
        }
    path = draw(
        st.sampled_from(
            ["/v1/chat/completions", "/v1/completions", "/generate"] * 3 + ["/abort_request"]
        )
    )
    if kind == "body":
        # Sometimes not an object at all.
        payload = (
            draw(body(POSTS[path])) if draw(st.sampled_from([True] * 9 + [False])) else draw(JUNK)
        )
        if (
            path == "/abort_request"
            and isinstance(payload, dict)
            and payload.get("abort_all") is True
        ):
            payload["abort_all"] = False
        return {
            "method": "POST",
            "url": path,
            "headers": headers,
            "content": json.dumps(payload, ensure_ascii=False),
        }
    if kind == "raw":  # not JSON, half JSON, JSON5, NaN, a lone surrogate, non-UTF-8
        content = draw(
            st.binary(max_size=200)
            | st.sampled_from(
                [
                    b"",
                    b"{",
                    b'{"messages": [',
                    b"{'a': 1}",
                    b'{"prompt": NaN}',
                    b'{"prompt": "\\ud800"}',
                    b"\xff\xfe",
                    b'{"prompt": "hi", "max_tokens": 1e400}',
                    b"[" * 5000 + b"]" * 5000,
                    b'{"prompt": "a"' + b", " * 3 + b"}",
                ]
            )
        )
        return {"method": "POST", "url": path, "headers": headers, "content": content}
    if kind == "auth":
        bad = draw(
            st.sampled_from(
                [
                    {},
                    {"Authorization": "Bearer wrong"},
                    {"Authorization": API_KEY},
                    {"Authorization": "Bearer  " + API_KEY},
                    {"Authorization": "Basic " + API_KEY},
                ]
            )
        )
        return {
            "method": "POST",
            "url": path,
            "headers": {"Content-Type": "application/json", **bad},
            "content": json.dumps({"prompt": "hi", "max_tokens": 1}),
        }
    return {
        "method": draw(st.sampled_from(["PUT", "DELETE", "PATCH", "GET"])),
        "url": path,
        "headers": headers,
    }


# ----- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("fuzz-logs"), heartbeat_interval=0.5)
    flags = [
        *cpu_flags(16384, tiny_llama_dir),
        "--max-tokens-cap",
        str(MAX_TOKENS_CAP),
        "--api-key",
        API_KEY,
        "--served-model-name",
        "fuzz-model",
    ]
    with launcher.serve(flags) as url:
        yield url


def check_answer(req: dict[str, Any], response: httpx2.Response) -> str:
    """Fail unless `response` is what its endpoint promises; return its outcome's name."""
    text = response.text
    sent = f"{req['method']} {req['url']} {str(req.get('content'))[:300]!r}"
    where = f"{sent} → {response.status_code} {text[:300]!r}"
    assert response.status_code < 500, where
    assert "Traceback" not in text and 'File "/' not in text, where
    if req["url"] == "/metrics" or (
        req["url"] in ("/health", "/healthz") and response.status_code == 200
    ):
        return str(response.status_code)
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in text.split("\n") if line]
        assert lines and all(line.startswith("data: ") for line in lines), where
        assert lines[-1] == "data: [DONE]", where
        events = [strict_json(line[len("data: ") :]) for line in lines[:-1]]
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) <= 1 and (not errors or "error" in events[-1]), where
        return f"200 stream{' error ' + errors[0]['code'] if errors else ''}"
    payload = strict_json(text)
    if response.status_code >= 400:
        error = payload["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], where
        return f"{response.status_code} {error['code']} {error['param']}"
    if req["url"] in ("/v1/chat/completions", "/v1/completions"):
        assert payload["choices"] and "usage" in payload, where
    elif req["url"] == "/generate":
        for answer in payload if isinstance(payload, list) else [payload]:
            assert isinstance(answer["text"], str) and "meta_info" in answer, where
    return str(response.status_code)


OUTCOMES: Counter[str] = Counter()


@settings(
    max_examples=BATCHES,
    suppress_health_check=list(HealthCheck),
    deadline=None,
    derandomize=True,
    database=None,
)
@given(batch=st.lists(request(), min_size=BATCH_SIZE, max_size=BATCH_SIZE))
def run_batch(base_url: str, batch: list[dict[str, Any]]) -> None:
    with httpx2.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S) as client:

        def send(req: dict[str, Any]) -> str:
            try:
                response = client.request(**req)
            except httpx2.TimeoutException:
                pytest.fail(
                    f"no answer within {CLIENT_TIMEOUT_S:g} s: {req['method']} {req['url']} "
                    f"{str(req.get('content'))[:300]!r}"
                )
            return check_answer(req, response)

        with ThreadPoolExecutor(8) as pool:
            OUTCOMES.update(pool.map(send, batch))


def test_a_thousand_fuzzed_requests_get_no_5xx_no_hang_no_stack_trace_and_the_server_still_serves(
    base_url: str,
):
    OUTCOMES.clear()
    run_batch(base_url)
    print("fuzz outcomes:", dict(OUTCOMES.most_common()))
    assert sum(OUTCOMES.values()) >= BATCHES * BATCH_SIZE
    assert OUTCOMES["200"] > 0 and any(
        k.startswith("200 stream") for k in OUTCOMES
    )  # some got through
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx2.Client(base_url=base_url, headers=headers, timeout=30) as client:
        assert client.get("/health").status_code == 200
        answer = client.post("/v1/completions", json={"prompt": "Still there?", "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] is not None

        assert_idle_and_whole(client)


# What earlier fuzz runs found, kept as fixed examples: each was a 500 or a server-side
# blow-up (a 64-bit overflow on the wire, millions of fanned-out requests).
FOUND = [
    ("/v1/completions", {"prompt": "hi", "priority": 2**64}, "priority"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, "top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**64}}, "sampling_params.top_k"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2**64}}, "sampling_params.n"),
    ("/v1/completions", {"prompt": "hi", "n": 10**8}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 1025}, "n"),
    ("/v1/completions", {"prompt": ["hi"] * 1025}, "prompt"),
    ("/generate", {"input_ids": [[1, 2]] * 1025}, "input_ids"),
    # Numbers past what float32 holds: each was a 500 (an overflow to inf, then NaN).
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 1e39}},
        "logit_bias",
    ),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e39}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-40}, "repetition_penalty"),
    (
        "/generate",
        {"text": "hi", "sampling_params": {"temperature": 10**400}},
        "sampling_params.temperature",
    ),
]


@pytest.mark.parametrize(("path", "payload", "param"), FOUND, ids=[p for _, _, p in FOUND])
def test_values_past_what_the_server_can_carry_get_a_400_naming_the_field(
    base_url: str, path: str, payload: dict[str, Any], param: str
):
    response = httpx2.post(
        base_url + path, json=payload, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
