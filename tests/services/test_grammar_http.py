"""Constrained decoding through the HTTP API: the three real processes on the embedded
model, the official `openai` client, outputs checked with the `jsonschema` library."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx2
import jsonschema
import openai
import pytest

from benchmarks.support.grammar_schemas import SCHEMAS
from tests.services.conftest import EMBEDDED_WORKER_MAX_DEPTH

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
YES_NO = 'root ::= answer "." \nanswer ::= "yes" | "no"'


def json_schema_format(schema: dict, name: str) -> dict:
    """The OpenAI `response_format` that constrains an answer to `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture(scope="module")
def base_url(embedded_server: str) -> str:
    return embedded_server


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_twenty_json_schemas_through_response_format_validate_and_stop(client: openai.OpenAI):
    def ask(name: str) -> tuple[str, openai.types.chat.ChatCompletion]:
        prompt, schema = SCHEMAS[name]
        return name, client.chat.completions.create(
            model="embedded",
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=96,
            response_format=json_schema_format(schema, "answer"),
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # concurrent: they share batches
        answers = list(pool.map(ask, SCHEMAS))
    assert len(answers) == 20
    for name, answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][1])


def test_json_object_regex_and_ebnf(client: openai.OpenAI):
    chat = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "A person as JSON."}],
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    phone = client.completions.create(
        model="embedded",
        prompt="A US phone number:",
        temperature=0,
        max_tokens=32,
        extra_body={"regex": PHONE},
    )
    assert re.fullmatch(PHONE, phone.choices[0].text) and phone.choices[0].finish_reason == "stop"
    answer = client.completions.create(
        model="embedded",
        prompt="Is the sky blue?",
        temperature=0,
        max_tokens=8,
        extra_body={"ebnf": YES_NO},
    )
    assert answer.choices[0].text in ("yes.", "no.")


def test_a_streamed_json_schema_answer_equals_the_non_streamed_one(client: openai.OpenAI):
    prompt, schema = SCHEMAS["nested object"]
    kwargs = dict(
        model="embedded",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=96,
        response_format=json_schema_format(schema, "person"),
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stream=True)
    )
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), schema)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": json_schema_format({"type": "nonsense"}, "x")},
            "response_format",
            'Unsupported type "nonsense"',
        ),
        ({"regex": "(abc"}, "regex", "invalid regex"),
        (
            {"response_format": json_schema_format(nested_schema(80), "x")},
            "response_format",
            "nests 161 levels deep; the limit is 150",
        ),
        (
            {"ebnf": "root ::= " + "(" * 300 + '"a"' + ")" * 300},
            "ebnf",
            "ebnf nests 300 levels deep; the limit is 150",
        ),
    ],
    ids=["invalid schema", "invalid regex", "deeply nested schema", "deeply nested ebnf"],
)
def test_bad_grammars_get_400_while_a_stream_keeps_flowing(
    base_url: str, client: openai.OpenAI, fields, param, message
):
    tokens: list[str] = []

    def stream() -> None:
        for chunk in client.completions.create(
            model="embedded",
            prompt="Once upon a time",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            tokens.append(chunk.choices[0].text)

    flowing = threading.Thread(target=stream)
    flowing.start()
    body = {
        "model": "embedded",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        **fields,
    }
    response = httpx2.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    flowing.join(timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        error["param"] == param
        and message in error["message"]
        and "Traceback" not in error["message"]
    )
    assert not flowing.is_alive() and len(tokens) >= 40


def test_a_grammar_the_worker_refuses_after_the_headers_ends_the_stream_with_an_error_event(
    base_url: str,
):
    # 2 × 64 + 1 levels: within the tokenizer's limit only
    schema = nested_schema(EMBEDDED_WORKER_MAX_DEPTH)
    body = {
        "model": "embedded",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": True,
        "response_format": json_schema_format(schema, "deep"),
    }
    with httpx2.stream(
        "POST", base_url + "/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200  # the stream had started
        events = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "nests 129 levels deep; the limit is 64" in error["message"]
    assert error["code"] and "Traceback" not in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_native_generate_returns_the_final_ids_after_jump_forward_rollbacks(
    base_url: str, tokenizer, stream: bool
):
    prompt, schema = SCHEMAS["$defs and $ref"]
    body = {
        "text": prompt,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": 96, "json_schema": schema},
    }
    with httpx2.stream("POST", base_url + "/generate", json=body, timeout=120) as response:
        assert response.status_code == 200
        if stream:  # each event is the answer so far
            events = [
                line.removeprefix("data: ")
                for line in response.iter_lines()
                if line.startswith("data: ")
            ]
            answer = json.loads(events[-2])
        else:
            answer = json.loads(response.read())
    jsonschema.validate(json.loads(answer["text"]), schema)
    assert tokenizer.decode(answer["output_ids"], skip_special_tokens=True) == answer["text"]
    assert answer["meta_info"]["completion_tokens"] == len(answer["output_ids"])
