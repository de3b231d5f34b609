"""Hostile numbers and sizes against the three real processes: every numeric field at the
float32 / int64 edges of its range (the largest accepted is a 200 whose JSON is finite, the
first refused, NaN, Infinity and a huge number are a 400 naming the field), the size limits
of stop strings, stop_token_ids, logit_bias and top logprobs, logprobs of tokens a grammar
forbids shown at a finite floor, and a fuzz over sampling parameters whose every answer and
every stream event must parse as strict JSON. After each case a good request is still
served, and after each test the KV pool is idle and whole.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling.sampling_params import MAX_TEMPERATURE, MIN_REPETITION_PENALTY, SAMPLING_EPS
from services.tokenizer.choice_output import LOGPROB_FLOOR
from testing.launcher import ServiceLauncher, cpu_flags
from testing.net import assert_idle_and_whole
from tests.services.conftest import strict_json

CHAT, COMPLETIONS, GENERATE, RESPONSES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/generate",
    "/v1/responses",
)
LIMIT_FLAGS = {
    "--max-stop-strings": 8,
    "--max-stop-string-length": 64,
    "--max-stop-token-ids": 16,
    "--max-logit-bias": 16,
}
"""Smaller than the defaults, so that the bodies past them are small and the flags are seen
to reach the tokenizer."""
USER = [{"role": "user", "content": "Say yes."}]


@pytest.fixture(scope="module")
def base_url(launcher: ServiceLauncher, tiny_llama_dir: Path) -> Iterator[str]:
    flags = [*cpu_flags(8192, tiny_llama_dir), "--max-tokens-cap", "4"]
    for flag, limit in LIMIT_FLAGS.items():
        flags += [flag, str(limit)]
    with launcher.serve(flags) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=base_url, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def kv_pool_left_idle_and_whole(client: httpx2.Client) -> Iterator[None]:
    """After each test, whatever its cases did: no KV slot leaked and the radix tree is
    whole, checked by the test's own teardown so that any order or subset checks it."""
    yield
    assert_idle_and_whole(client)


def strict_answer(response: httpx2.Response) -> Any:
    """The body, or for a stream the list of its events, each parsed strictly."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return strict_json(response.text)
    events = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(strict_json(line.removeprefix("data: ")))
    return events


def post(client: httpx2.Client, path: str, body: dict[str, Any] | str) -> httpx2.Response:
    """`body` as JSON, where Python's encoder writes NaN and Infinity as their JavaScript
    literals (which the API parses), or a raw string sent as it is."""
    content = body if isinstance(body, str) else json.dumps(body)
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_still_serves(client: httpx2.Client) -> None:
    response = post(client, COMPLETIONS, {"prompt": "Still there?", "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert strict_json(response.text)["choices"][0]["finish_reason"] in ("length", "stop")


def assert_refused(response: httpx2.Response, param: str, code: str | None = None) -> str:
    """A 400 with OpenAI's error body naming `param`; its message."""
    assert response.status_code == 400, response.text
    error = strict_json(response.text)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert code is None or error["code"] == code, error
    return str(error["message"])


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Say yes.", "max_tokens": 2, **fields}


def generate(**sampling: Any) -> dict[str, Any]:
    return {"text": "Say yes.", "sampling_params": {"max_new_tokens": 2, **sampling}}


def responses(**fields: Any) -> dict[str, Any]:
    return {"input": "Say yes.", "max_output_tokens": 2, **fields}


INF, NAN = float("inf"), float("nan")
ACCEPTED = [
    # (id, path, body): the largest (or smallest) value each field accepts.
    ("temperature at its ceiling", CHAT, chat(temperature=MAX_TEMPERATURE, logprobs=True)),
    ("temperature at the least sampled", COMPLETIONS, completion(temperature=SAMPLING_EPS)),
    ("temperature subnormal (greedy)", COMPLETIONS, completion(temperature=5e-324)),
    ("temperature -0.0 (greedy)", CHAT, chat(temperature=-0.0)),
    ("top_p subnormal", CHAT, chat(top_p=5e-324, temperature=1.0)),
    ("top_p 1", COMPLETIONS, completion(top_p=1.0)),
    ("top_k 1", COMPLETIONS, completion(top_k=1)),
    ("top_k the int64 maximum", COMPLETIONS, completion(top_k=2**63 - 1)),
    ("min_p 1", CHAT, chat(min_p=1.0)),
    ("min_p subnormal", CHAT, chat(min_p=5e-324)),
    ("penalties at +2", CHAT, chat(frequency_penalty=2.0, presence_penalty=2.0)),
    ("penalties at -2", COMPLETIONS, completion(frequency_penalty=-2.0, presence_penalty=-2.0)),
    ("repetition_penalty at its floor", CHAT, chat(repetition_penalty=MIN_REPETITION_PENALTY)),
    ("repetition_penalty 2", COMPLETIONS, completion(repetition_penalty=2.0)),
    ("logit_bias +-100", CHAT, chat(logit_bias={"1": 100, "2": -100.0}, logprobs=True)),
    ("seed 0", COMPLETIONS, completion(seed=0, temperature=1.0)),
    ("seed the int64 maximum", COMPLETIONS, completion(seed=2**63 - 1, temperature=1.0)),
    ("top_logprobs 20", CHAT, chat(logprobs=True, top_logprobs=20)),
    ("top_logprobs 20 streamed", CHAT, chat(logprobs=True, top_logprobs=20, stream=True)),
    ("completions logprobs 5", COMPLETIONS, completion(logprobs=5)),
    ("completions echo with logprobs 5", COMPLETIONS, completion(logprobs=5, echo=True)),
    ("prompt_logprobs 20", COMPLETIONS, completion(prompt_logprobs=20)),
    (
        "generate top_logprobs_num 20",
        GENERATE,
        {**generate(), "return_logprob": True, "top_logprobs_num": 20, "logprob_start_len": 0},
    ),
    ("generate temperature at its ceiling", GENERATE, generate(temperature=MAX_TEMPERATURE)),
    ("generate repetition_penalty floor", GENERATE, generate(repetition_penalty=0.01)),
    ("responses temperature at its ceiling", RESPONSES, responses(temperature=MAX_TEMPERATURE)),
    ("responses top_p subnormal", RESPONSES, responses(top_p=5e-324)),
]

REFUSED = [
    # (id, path, body, param): the first value past each edge, and values that are not numbers
    ("temperature past its ceiling", CHAT, chat(temperature=MAX_TEMPERATURE * 1.01), "temperature"),
    ("temperature 1e39", COMPLETIONS, completion(temperature=1e39), "temperature"),
    ("temperature Infinity", CHAT, chat(temperature=INF), "temperature"),
    ("temperature NaN", CHAT, chat(temperature=NAN), "temperature"),
    ("temperature 1e400", COMPLETIONS, '{"prompt": "a", "temperature": 1e400}', "temperature"),
    ("temperature negative subnormal", CHAT, chat(temperature=-5e-324), "temperature"),
    ("top_p 0", CHAT, chat(top_p=0.0), "top_p"),
    ("top_p past 1", COMPLETIONS, completion(top_p=1.0000001), "top_p"),
    ("top_p -Infinity", COMPLETIONS, completion(top_p=-INF), "top_p"),
    ("top_k 0", CHAT, chat(top_k=0), "top_k"),
    ("top_k past int64", COMPLETIONS, completion(top_k=2**63), "top_k"),
    ("min_p past 1", CHAT, chat(min_p=1.0000001), "min_p"),
    ("frequency_penalty past 2", CHAT, chat(frequency_penalty=2.0000001), "frequency_penalty"),
    ("presence_penalty -Infinity", CHAT, chat(presence_penalty=-INF), "presence_penalty"),
    (
        "repetition_penalty 1e-40",
        COMPLETIONS,
        completion(repetition_penalty=1e-40),
        "repetition_penalty",
    ),
    (
        "repetition_penalty under its floor",
        CHAT,
        chat(repetition_penalty=MIN_REPETITION_PENALTY * 0.99),
        "repetition_penalty",
    ),
    ("repetition_penalty past 2", CHAT, chat(repetition_penalty=2.01), "repetition_penalty"),
    ("logit_bias past 100", CHAT, chat(logit_bias={"1": 100.5}), "logit_bias"),
    ("logit_bias 1e39", CHAT, chat(logit_bias={"1": 1e39}), "logit_bias"),
    ("logit_bias -Infinity", COMPLETIONS, completion(logit_bias={"1": -INF}), "logit_bias"),
    ("logit_bias NaN", COMPLETIONS, completion(logit_bias={"1": NAN}), "logit_bias"),
    ("seed negative", COMPLETIONS, completion(seed=-1), "seed"),
    ("seed past int64", COMPLETIONS, completion(seed=2**63), "seed"),
    ("n 0", CHAT, chat(n=0), "n"),
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top_logprobs the vocabulary", CHAT, chat(logprobs=True, top_logprobs=49152), "top_logprobs"),
    ("completions logprobs 6", COMPLETIONS, completion(logprobs=6), "logprobs"),
    ("prompt_logprobs 21", COMPLETIONS, completion(prompt_logprobs=21), "prompt_logprobs"),
    (
        "generate top_logprobs_num 21",
        GENERATE,
        {**generate(), "return_logprob": True, "top_logprobs_num": 21},
        "top_logprobs_num",
    ),
    (
        "generate temperature 1e39",
        GENERATE,
        generate(temperature=1e39),
        "sampling_params.temperature",
    ),
    (
        "generate temperature a 400-digit integer",
        GENERATE,
        generate(temperature=10**400),
        "sampling_params.temperature",
    ),
    (
        "generate repetition_penalty 1e-40",
        GENERATE,
        generate(repetition_penalty=1e-40),
        "sampling_params.repetition_penalty",
    ),
    (
        "generate logit_bias a 400-digit integer",
        GENERATE,
        generate(logit_bias={"1": -(10**400)}),
        "sampling_params.logit_bias",
    ),
    ("generate top_p NaN", GENERATE, generate(top_p=NAN), "sampling_params.top_p"),
    ("responses temperature 1e39", RESPONSES, responses(temperature=1e39), "temperature"),
    ("responses top_p 0", RESPONSES, responses(top_p=0.0), "top_p"),
]


@pytest.mark.parametrize(("path", "body"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_the_edge_of_each_numeric_range_is_served_with_finite_json(
    client: httpx2.Client, path: str, body: dict[str, Any]
) -> None:
    response = post(client, path, body)
    assert response.status_code == 200, response.text
    answer = strict_answer(response)
    assert answer, response.text
    assert_still_serves(client)


@pytest.mark.parametrize(
    ("path", "body", "param"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_a_number_past_the_edge_is_a_400_naming_its_field(
    client: httpx2.Client, path: str, body: dict[str, Any] | str, param: str
) -> None:
    assert_refused(post(client, path, body), param)
    assert_still_serves(client)


SIZES = [
    # (id, field, a value at the limit, one past it, the limit's flag)
    (
        "stop strings",
        "stop",
        [f"s{i}" for i in range(8)],
        [f"s{i}" for i in range(9)],
        "--max-stop-strings",
    ),
    ("stop string length", "stop", ["x" * 64], ["x" * 65], "--max-stop-string-length"),
    ("stop_token_ids", "stop_token_ids", list(range(16)), list(range(17)), "--max-stop-token-ids"),
    (
        "logit_bias entries",
        "logit_bias",
        {str(i): 1 for i in range(16)},
        {str(i): 1 for i in range(17)},
        "--max-logit-bias",
    ),
]
ENDPOINTS = {
    "chat": (chat, CHAT, ""),
    "completions": (completion, COMPLETIONS, ""),
    "generate": (generate, GENERATE, "sampling_params."),
}


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize(
    ("field", "at_limit", "past", "flag"), [s[1:] for s in SIZES], ids=[s[0] for s in SIZES]
)
def test_sizes_up_to_their_limit_are_served_and_past_it_are_a_400_naming_limit_and_flag(
    client: httpx2.Client, endpoint: str, field: str, at_limit: Any, past: Any, flag: str
) -> None:
    make, path, prefix = ENDPOINTS[endpoint]
    served = post(client, path, make(**{field: at_limit}))
    assert served.status_code == 200, served.text
    strict_answer(served)
    message = assert_refused(post(client, path, make(**{field: past})), prefix + field)
    assert flag in message and str(LIMIT_FLAGS[flag]) in message, message
    assert_still_serves(client)


def logprob_values(path: str, answer: Any) -> list[float]:
    """Every alternative's logprob in `answer` (a stream's events or a whole body)."""
    values: list[float] = []
    for part in answer if isinstance(answer, list) else [answer]:
        if path == GENERATE:
            for top in part.get("meta_info", {}).get("output_top_logprobs") or []:
                values += [entry[0] for entry in top]
            continue
        for choice in part.get("choices", []):
            logprobs = choice.get("logprobs") or {}
            for token in logprobs.get("content") or []:  # chat
                values += [t["logprob"] for t in token["top_logprobs"]]
            for top in logprobs.get("top_logprobs") or []:  # completions
                values += list((top or {}).values())
    return values


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, chat(regex="a", logprobs=True, top_logprobs=5)),
        (COMPLETIONS, completion(regex="a", logprobs=5)),
        (GENERATE, {**generate(regex="a"), "return_logprob": True, "top_logprobs_num": 5}),
    ],
    ids=["chat", "completions", "generate"],
)
def test_logprobs_of_tokens_a_grammar_forbids_are_shown_at_a_finite_floor(
    client: httpx2.Client, path: str, body: dict[str, Any], stream: bool
) -> None:
    response = post(client, path, {**body, "stream": stream})
    assert response.status_code == 200, response.text
    values = logprob_values(path, strict_answer(response))
    assert LOGPROB_FLOOR in values, values  # the grammar allows one token: the others are -inf
    assert min(values) == LOGPROB_FLOOR


EDGES = st.sampled_from(
    [0.0, -0.0, 5e-324, 1e-45, 1e-40, 1.2e-38, 1e-6, 0.01, 0.5, 1.0, 2.0, 100.0, 1e4, 1e39]
    + [1e308, -1e-40, -1.0, -2.0, -100.0, -1e39, INF, -INF, NAN, 2**63, 10**400]
)
NUMBER = EDGES | st.floats(0.01, 1.0) | st.floats()
"""An edge, a value every float field accepts, or any float."""
SAMPLING = {
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": st.integers(-2, 2**63) | EDGES,
    "min_p": NUMBER,
    "frequency_penalty": NUMBER,
    "presence_penalty": NUMBER,
    "repetition_penalty": NUMBER,
    "seed": st.integers(-1, 2**64) | EDGES,
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), NUMBER, max_size=3),
}


@st.composite
def sampled_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A request with a few sampling parameters at edges, logprobs on, maybe streamed."""
    names = draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=3, unique=True))
    fields = {name: draw(SAMPLING[name]) for name in names}
    stream = draw(st.booleans())
    path = draw(st.sampled_from([CHAT, COMPLETIONS, GENERATE]))
    if path == CHAT:
        return path, chat(
            logprobs=True, top_logprobs=draw(st.integers(0, 20)), stream=stream, **fields
        )
    if path == COMPLETIONS:
        return path, completion(logprobs=draw(st.integers(0, 5)), stream=stream, **fields)
    top = draw(st.integers(0, 20))
    return path, {
        **generate(**fields),
        "return_logprob": True,
        "top_logprobs_num": top,
        "stream": stream,
    }


def test_sampling_parameters_at_any_edge_give_strict_json_in_every_answer_and_event(
    client: httpx2.Client,
) -> None:
    outcomes: list[int] = []

    @settings(
        max_examples=80,
        suppress_health_check=list(HealthCheck),
        deadline=None,
        derandomize=True,
        database=None,
    )
    @given(case=sampled_request())
    def run_fuzz(case: tuple[str, dict[str, Any]]) -> None:
        path, body = case
        response = post(client, path, body)
        assert response.status_code in (200, 400), (
            f"{path} {body} → {response.status_code} {response.text}"
        )
        answer = strict_answer(response)
        if response.status_code == 400:
            assert answer["error"]["param"], answer
        outcomes.append(response.status_code)

    run_fuzz()
    print("outcomes:", Counter(outcomes))
    assert 200 in outcomes and 400 in outcomes, outcomes
    assert_still_serves(client)
