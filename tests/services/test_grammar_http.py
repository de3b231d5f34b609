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

from testing.grammar_schemas import SCHEMAS
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


IF_THEN = {
    "type": "object",
    "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
    "required": ["kind"],
    "allOf": [{"if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]}}],
}
"""The shape of JSONSchemaStore's saucectl schema: an `allOf` of `if`/`then` branches."""
TOOL = {"type": "function", "function": {"name": "pick", "parameters": IF_THEN}}
CHAT = {
    "model": "embedded",
    "messages": [{"role": "user", "content": "Pick one."}],
    "max_tokens": 24,
}


@pytest.mark.parametrize(
    ("path", "body", "param", "where"),
    [
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": json_schema_format(IF_THEN, "x")},
            "response_format",
            "#/allOf/0/if",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [TOOL], "tool_choice": "required"},
            "tool_choice",
            "/allOf/0/if",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 24, "structured_outputs": {"json": IF_THEN}},
            "structured_outputs",
            "#/allOf/0/if",
        ),
        (
            "/generate",
            {"text": "x", "sampling_params": {"max_new_tokens": 24, "json_schema": IF_THEN}},
            "sampling_params.json_schema",
            "#/allOf/0/if",
        ),
    ],
    ids=["response_format", "forced tool", "structured_outputs", "generate"],
)
def test_an_unenforced_keyword_is_refused_on_every_path_unless_best_effort(
    base_url: str, path, body, param, where
):
    response = httpx2.post(base_url + path, json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert f"{param} uses 'if' at " in error["message"] and where in error["message"]
    assert "json_schema_best_effort" in error["message"]
    served = httpx2.post(
        base_url + path, json={**body, "json_schema_best_effort": True}, timeout=120
    )
    assert served.status_code == 200, served.text


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "minItems": 1, "maxItems": 3},
        {
            "type": "object",
            "properties": {"choice": {"oneOf": [{"type": "integer"}, {"type": "null"}]}},
            "required": ["choice"],
        },
        {  # xgrammar does not enforce it: auto serves it with llguidance, which merges it
            "allOf": [
                {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                    "additionalProperties": False,
                    "required": ["n"],
                },
                {"required": ["ok"]},
            ]
        },
    ],
    ids=["minItems without items", "oneOf of disjoint types", "allOf of two schemas"],
)
def test_satisfiable_schemas_of_enforced_keywords_are_served_and_validate(
    client: openai.OpenAI, schema
):
    answer = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "Answer as JSON."}],
        temperature=0,
        max_tokens=48,
        response_format=json_schema_format(schema, "answer"),
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)
