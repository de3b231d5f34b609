"""Requests in: the bad-input table answered with OpenAI error bodies, the mapping of every
field onto SamplingParams, the prompt forms, and the chat template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from transformers import PreTrainedTokenizerBase

from engine.sampling.sampling_params import SamplingParams
from services.settings import Settings
from services.tokenizer.chat_template import render_chat
from services.tokenizer.errors import RequestError, error_body, validation_error_body
from services.tokenizer.protocol.chat import ChatCompletionRequest
from services.tokenizer.protocol.completions import CompletionRequest
from services.tokenizer.protocol.native import GenerateRequest
from services.tokenizer.request_mapper import (
    check_chat_request,
    check_completion_request,
    check_model,
    to_sampling_params,
    tokenize_prompts,
)

MODEL = "smollm2"
CONTEXT_LEN = 64
MAX_TOKENS_CAP = 32
VOCAB = 49152
GRAMMAR_LIMITS = {"grammar_max_bytes": 4096, "grammar_max_nesting_depth": 8}
LIMITS = {
    "max_tokens_cap": MAX_TOKENS_CAP,
    "context_len": CONTEXT_LEN,
    "vocab_size": VOCAB,
    **GRAMMAR_LIMITS,
    "limits": Settings(),
}
USER = [{"role": "user", "content": "hi"}]


def answer(
    model: type[BaseModel], body: dict[str, Any] | str, tokenizer: PreTrainedTokenizerBase
) -> tuple[int, dict[str, Any]]:
    """What the tokenizer service answers before it submits anything: the request parsed
    from raw JSON, checked, tokenized and mapped; (status, body) on failure, (200, {}) if
    it would be submitted."""
    try:
        request = model.model_validate_json(body if isinstance(body, str) else json.dumps(body))
    except ValidationError as exc:
        return 400, validation_error_body(exc)
    try:
        if isinstance(request, ChatCompletionRequest):
            check_model(request.model, MODEL)
            check_chat_request(request)
            prompt = render_chat(
                tokenizer,
                request.messages,
                tools=request.tools,
                template_kwargs=request.chat_template_kwargs,
            )
            prompts = [prompt.ids]
        else:
            if isinstance(request, CompletionRequest):
                check_model(request.model, MODEL)
                check_completion_request(request)
            prompts = tokenize_prompts(request, tokenizer, VOCAB)
        for ids in prompts:
            to_sampling_params(request, len(ids), **LIMITS)
    except RequestError as err:
        return err.status, error_body(err)
    return 200, {}


CHAT, COMPLETION, GENERATE = ChatCompletionRequest, CompletionRequest, GenerateRequest
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


BAD_INPUT = [
    # (id, request model, body, status, param)
    ("malformed JSON", CHAT, '{"messages": [', 400, None),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("missing prompt", COMPLETION, {"model": MODEL}, 400, "prompt"),
    ("empty prompt text", COMPLETION, {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", COMPLETION, {"prompt": []}, 400, "prompt"),
    ("empty token-id list in a batch", COMPLETION, {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("texts mixed with token ids", COMPLETION, {"prompt": ["a", [1]]}, 400, "prompt"),
    ("unknown model", CHAT, {"model": "gpt-4", "messages": USER}, 404, "model"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "messages"),
    ("temperature a string", CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("n a numeric string", CHAT, {"messages": USER, "n": "2"}, 400, "n"),
    ("max_tokens fractional", CHAT, {"messages": USER, "max_tokens": 1.5}, 400, "max_tokens"),
    ("stream not a bool", CHAT, {"messages": USER, "stream": "yes"}, 400, "stream"),
    ("stop a number", CHAT, {"messages": USER, "stop": 5}, 400, "stop"),
    (
        "content a number",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "image content part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "logit_bias value a string",
        CHAT,
        {"messages": USER, "logit_bias": {"5": "x"}},
        400,
        "logit_bias.5",
    ),
    ("max_tokens 0", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", COMPLETION, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    (
        "max_completion_tokens 0",
        CHAT,
        {"messages": USER, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    (
        "max_tokens beyond the context",
        COMPLETION,
        {"prompt": [1, 2, 3], "max_tokens": CONTEXT_LEN},
        400,
        "max_tokens",
    ),
    ("prompt longer than the context", COMPLETION, {"prompt": [5] * CONTEXT_LEN}, 400, "prompt"),
    (
        "chat prompt longer than the context",
        CHAT,
        {"messages": [{"role": "user", "content": "hi " * 100}]},
        400,
        "messages",
    ),
    ("temperature < 0", CHAT, {"messages": USER, "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", CHAT, {"messages": USER, "top_p": 0.0}, 400, "top_p"),
    ("top_p > 1", COMPLETION, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("n 0", CHAT, {"messages": USER, "n": 0}, 400, "n"),
    (
        "unknown role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    (
        "logit_bias id beyond the vocabulary",
        CHAT,
        {"messages": USER, "logit_bias": {str(VOCAB): 1.0}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias id negative",
        CHAT,
        {"messages": USER, "logit_bias": {"-1": 1.0}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias key not an id",
        CHAT,
        {"messages": USER, "logit_bias": {"hello": 1.0}},
        400,
        "logit_bias",
    ),
    ("prompt token id beyond the vocabulary", COMPLETION, {"prompt": [1, VOCAB]}, 400, "prompt"),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"messages": USER, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "min_tokens above max_tokens",
        CHAT,
        {"messages": USER, "max_tokens": 4, "min_tokens": 5},
        400,
        "min_tokens",
    ),
    ("generate without a prompt", GENERATE, {"sampling_params": {}}, 400, None),
    ("generate with both prompt forms", GENERATE, {"text": "a", "input_ids": [1]}, 400, None),
    (
        "generate unknown sampling parameter",
        GENERATE,
        {"text": "a", "sampling_params": {"max_tokens": 4}},
        400,
        "sampling_params",
    ),
    (
        "generate temperature < 0",
        GENERATE,
        {"text": "a", "sampling_params": {"temperature": -1}},
        400,
        "sampling_params.temperature",
    ),
    (
        "generate max_new_tokens a string",
        GENERATE,
        {"text": "a", "sampling_params": {"max_new_tokens": "9"}},
        400,
        "sampling_params.max_new_tokens",
    ),
    (
        "generate input id beyond the vocabulary",
        GENERATE,
        {"input_ids": [[1], [VOCAB]]},
        400,
        "input_ids",
    ),
    (
        "response_format of an unknown type",
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "response_format.type",
    ),
    (
        "json_schema format without its schema",
        CHAT,
        {"messages": USER, "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    (
        "json_schema format with a schema that is not an object",
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": "int"},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (
        "invalid json schema",
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "nonsense"}},
            },
        },
        400,
        "response_format",
    ),
    (
        "json schema nested beyond the limit",
        CHAT,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "schema": json.loads(
                        '{"type": "array", "items": ' * 9 + '{"type": "integer"}' + "}" * 9
                    )
                },
            },
        },
        400,
        "response_format",
    ),
    ("invalid regex", COMPLETION, {"prompt": "hi", "regex": "[a-z"}, 400, "regex"),
    ("regex with a lookahead", COMPLETION, {"prompt": "hi", "regex": "a(?=b)"}, 400, "regex"),
    ("ebnf with an undefined rule", CHAT, {"messages": USER, "ebnf": "root ::= foo"}, 400, "ebnf"),
    (
        "regex and response_format together",
        CHAT,
        {"messages": USER, "regex": "a+", "response_format": {"type": "json_object"}},
        400,
        None,
    ),
    (
        "generate invalid json schema",
        GENERATE,
        {"text": "a", "sampling_params": {"json_schema": '{"type": 5}'}},
        400,
        "sampling_params.json_schema",
    ),
    (
        "generate schema that is not JSON",
        GENERATE,
        {"text": "a", "sampling_params": {"json_schema": "{oops"}},
        400,
        "sampling_params.json_schema",
    ),
    (
        "generate grammar over the size limit",
        GENERATE,
        {"text": "a", "sampling_params": {"regex": "a" * 5000}},
        400,
        "sampling_params.regex",
    ),
    # tools, prompt logprobs and fields known but not served
    ("tools not a list", CHAT, {"messages": USER, "tools": {"a": 1}}, 400, "tools"),
    (
        "tool without a function",
        CHAT,
        {"messages": USER, "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    (
        "tool of another type",
        CHAT,
        {"messages": USER, "tools": [{"type": "web_search", "function": {"name": "f"}}]},
        400,
        "tools[0].type",
    ),
    (
        "tool name with a space",
        CHAT,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        400,
        "tools[0].function.name",
    ),
    (
        "tool parameters not an object",
        CHAT,
        {
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
        },
        400,
        "tools[0].function.parameters",
    ),
    ("two tools of one name", CHAT, {"messages": USER, "tools": [TOOL, TOOL]}, 400, "tools"),
    (
        "tool_choice naming an unknown function",
        CHAT,
        {"messages": USER, "tools": [TOOL], "tool_choice": named("nope")},
        400,
        "tool_choice",
    ),
    (
        "tool_choice required without tools",
        CHAT,
        {"messages": USER, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    (
        "tool_choice unknown string",
        CHAT,
        {"messages": USER, "tools": [TOOL], "tool_choice": "always"},
        400,
        "tool_choice",
    ),
    (
        "forced tool with a response_format",
        CHAT,
        {
            "messages": USER,
            "tools": [TOOL],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        "tool_choice",
    ),
    (
        "tool message without tool_call_id",
        CHAT,
        {"messages": [*USER, {"role": "tool", "content": "42"}]},
        400,
        "messages[1]",
    ),
    (
        "tool_calls on a user message",
        CHAT,
        {"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]},
        400,
        "messages[0]",
    ),
    (
        "chat_template_kwargs overriding the tools",
        CHAT,
        {"messages": USER, "chat_template_kwargs": {"tools": []}},
        400,
        "chat_template_kwargs",
    ),
    (
        "continue_final_message with a generation prompt",
        CHAT,
        {"messages": USER, "continue_final_message": True},
        400,
        "continue_final_message",
    ),
    (
        "echo with n > 1 and logprobs",
        COMPLETION,
        {"prompt": "hi", "echo": True, "logprobs": 1, "n": 2},
        400,
        "n",
    ),
    ("max_tokens 0 without echo", COMPLETION, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "prompt_logprobs streamed",
        COMPLETION,
        {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs negative",
        COMPLETION,
        {"prompt": "hi", "prompt_logprobs": -1},
        400,
        "prompt_logprobs",
    ),
    (
        "prompt_logprobs on chat",
        CHAT,
        {"messages": USER, "prompt_logprobs": 1},
        400,
        "prompt_logprobs",
    ),
    ("echo on chat", CHAT, {"messages": USER, "echo": True}, 400, "echo"),
    ("audio output", CHAT, {"messages": USER, "audio": {"voice": "alloy"}}, 400, "audio"),
    (
        "modalities with audio",
        CHAT,
        {"messages": USER, "modalities": ["text", "audio"]},
        400,
        "modalities",
    ),
    (
        "deprecated functions",
        CHAT,
        {"messages": USER, "functions": [{"name": "f"}]},
        400,
        "functions",
    ),
    (
        "reasoning_effort",
        CHAT,
        {"messages": USER, "reasoning_effort": "high"},
        400,
        "reasoning_effort",
    ),
    ("best_of 2", COMPLETION, {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("suffix", COMPLETION, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("beam search", COMPLETION, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    (
        "vLLM guided_json",
        CHAT,
        {"messages": USER, "guided_json": {"type": "object"}},
        400,
        "guided_json",
    ),
    (
        "a custom chat_template",
        CHAT,
        {"messages": USER, "chat_template": "{{ 1 }}"},
        400,
        "chat_template",
    ),
    (
        "structured_outputs with two constraints",
        CHAT,
        {"messages": USER, "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "structured_outputs",
    ),
    (
        "structured_outputs and regex",
        COMPLETION,
        {"prompt": "hi", "structured_outputs": {"regex": "a"}, "regex": "b"},
        400,
        "structured_outputs",
    ),
    (
        "generate logprob_start_len past the prompt",
        GENERATE,
        {"text": "hi", "return_logprob": True, "logprob_start_len": -2},
        400,
        "logprob_start_len",
    ),
]


@pytest.mark.parametrize(
    ("model", "body", "status", "param"),
    [case[1:] for case in BAD_INPUT],
    ids=[case[0] for case in BAD_INPUT],
)
def test_bad_input_answers_an_openai_error_naming_the_field(model, body, status, param, tokenizer):
    got_status, got = answer(model, body, tokenizer)
    assert got_status == status
    assert list(got) == ["error"]
    error = got["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"] and "Traceback" not in error["message"]
    assert isinstance(error["code"], str)


def test_a_normal_request_passes_the_same_checks(tokenizer):
    assert answer(
        CHAT, {"model": MODEL, "messages": USER, "max_tokens": 8, "user": "someone"}, tokenizer
    ) == (200, {})


def test_fastapi_validation_errors_drop_the_body_location():
    missing = RequestValidationError(
        [{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}]
    )
    malformed = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 14), "msg": "JSON decode error"}]
    )
    assert validation_error_body(missing)["error"] == {
        "message": "messages: Field required",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "missing_required_parameter",
    }
    assert validation_error_body(malformed)["error"]["param"] is None
    assert validation_error_body(malformed)["error"]["code"] == "invalid_json"


def test_server_errors_have_the_server_error_type():
    body = error_body(RequestError("worker died", code="peer_dead", status=503))
    assert body == {
        "error": {
            "message": "worker died",
            "type": "server_error",
            "param": None,
            "code": "peer_dead",
        }
    }


def test_every_chat_field_maps_to_its_native_name():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "max_completion_tokens": 20,
            "max_tokens": 5,
            "min_tokens": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "n": 2,
            "stop": "END",
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "seed": 7,
            "logit_bias": {"42": -100.0, "7": 2},
            "logprobs": True,
            "top_logprobs": 3,
            "ignore_eos": True,
            "stop_token_ids": [2],
            "skip_special_tokens": False,
            "cache_salt": "tenant-a",
            "priority": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        }
    )
    params = to_sampling_params(request, 10, **LIMITS)
    assert params == SamplingParams(
        max_new_tokens=20,
        min_new_tokens=3,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        n=2,
        stop=["END"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=7,
        logit_bias={42: -100.0, 7: 2.0},
        logprobs=True,
        top_logprobs_num=3,
        ignore_eos=True,
        stop_token_ids=[2],
        skip_special_tokens=False,
        json_schema='{"type": "object"}',
    )
    # Not sampling parameters: the service reads them from the request.
    assert (request.cache_salt, request.priority) == ("tenant-a", 4)


@pytest.mark.parametrize(
    ("fields", "grammar"),
    [
        ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}')),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "integer"}},
                }
            },
            ("json_schema", '{"type": "integer"}'),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"regex": "[a-z]+"}, ("regex", "[a-z]+")),
        ({"ebnf": 'root ::= "yes" | "no"'}, ("ebnf", 'root ::= "yes" | "no"')),
    ],
    ids=["json_object", "json_schema", "text", "regex", "ebnf"],
)
def test_response_format_and_grammar_extras_become_one_grammar(fields, grammar):
    for model, body in ((CHAT, {"messages": USER}), (COMPLETION, {"prompt": "hi"})):
        params = to_sampling_params(model.model_validate({**body, **fields}), 1, **LIMITS)
        assert params.grammar == grammar


def test_unset_fields_keep_the_engine_defaults_and_max_tokens_fills_the_context_up_to_the_cap():
    chat = ChatCompletionRequest.model_validate({"messages": USER})
    assert to_sampling_params(chat, 10, **LIMITS) == SamplingParams(max_new_tokens=MAX_TOKENS_CAP)
    assert to_sampling_params(chat, CONTEXT_LEN - 5, **LIMITS).max_new_tokens == 5


def test_max_tokens_within_the_context_is_clamped_to_the_server_cap():
    request = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": CONTEXT_LEN - 1})
    assert to_sampling_params(request, 1, **LIMITS).max_new_tokens == MAX_TOKENS_CAP


def test_completion_logprobs_count_is_the_top_alternatives():
    params = to_sampling_params(
        CompletionRequest.model_validate({"prompt": "hi", "logprobs": 2}), 1, **LIMITS
    )
    assert (params.logprobs, params.top_logprobs_num) == (True, 2)
    params = to_sampling_params(
        CompletionRequest.model_validate({"prompt": "hi", "logprobs": 0}), 1, **LIMITS
    )
    assert (params.logprobs, params.top_logprobs_num) == (True, 0)
    params = to_sampling_params(CompletionRequest.model_validate({"prompt": "hi"}), 1, **LIMITS)
    assert not params.logprobs


def test_generate_takes_native_names_and_logprob_flags_beside_them():
    request = GenerateRequest.model_validate(
        {
            "text": "hi",
            "sampling_params": {
                "max_new_tokens": 8,
                "temperature": 0,
                "stop": ["x"],
                "min_new_tokens": 1,
            },
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
    )
    assert to_sampling_params(request, 1, **LIMITS) == SamplingParams(
        max_new_tokens=8,
        min_new_tokens=1,
        temperature=0,
        stop=["x"],
        logprobs=True,
        top_logprobs_num=2,
    )
    default = GenerateRequest.model_validate({"input_ids": [1, 2]})
    assert (
        to_sampling_params(
            default, 2, **{**LIMITS, "max_tokens_cap": 4096, "context_len": 2048}
        ).max_new_tokens
        == 128
    )


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
    ids=["token ids", "token-id lists"],
)
def test_token_id_prompts_pass_through_as_a_batch(prompt, expected):
    assert (
        tokenize_prompts(CompletionRequest.model_validate({"prompt": prompt}), None, VOCAB)
        == expected
    )


def test_text_prompts_are_tokenized_one_by_one(tokenizer):
    one = CompletionRequest.model_validate({"prompt": "Hello world"})
    many = CompletionRequest.model_validate({"prompt": ["Hello world", "Bye"]})
    assert tokenize_prompts(one, tokenizer, VOCAB) == [tokenizer.encode("Hello world")]
    assert tokenize_prompts(many, tokenizer, VOCAB) == [
        tokenizer.encode("Hello world"),
        tokenizer.encode("Bye"),
    ]


@pytest.mark.parametrize(
    ("body", "is_batch"),
    [
        ({"text": "a"}, False),
        ({"text": ["a", "b"]}, True),
        ({"input_ids": [1]}, False),
        ({"input_ids": [[1]]}, True),
    ],
)
def test_generate_remembers_whether_a_batch_was_sent(body, is_batch):
    for request in (
        GenerateRequest.model_validate(body),
        GenerateRequest.model_validate_json(json.dumps(body)),
    ):
        assert request.is_batch is is_batch
        assert len(request.prompts) == (2 if body.get("text") == ["a", "b"] else 1)


def test_chat_template_is_chatml_ending_with_the_assistant_prompt(tokenizer):
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Hello"},
                        {"type": "text", "text": "there"},
                    ],
                },
            ]
        }
    )
    ids = render_chat(tokenizer, request.messages).ids
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello\nthere<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids[:1] == tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2


SIZE_LIMITS = [
    # (id, request model, body, param, code, what the message names)
    (
        "33 stop strings",
        CHAT,
        {"messages": USER, "stop": [f"s{i}" for i in range(33)]},
        "stop",
        "array_above_max_length",
        "at most 32 are allowed (--max-stop-strings)",
    ),
    (
        "a stop string of 1025 characters",
        COMPLETION,
        {"prompt": "hi", "stop": ["ok", "x" * 1025]},
        "stop",
        "string_above_max_length",
        "at most 1024 are allowed (--max-stop-string-length)",
    ),
    (
        "257 stop_token_ids",
        GENERATE,
        {"text": "hi", "sampling_params": {"stop_token_ids": list(range(257))}},
        "sampling_params.stop_token_ids",
        "array_above_max_length",
        "at most 256 are allowed (--max-stop-token-ids)",
    ),
    (
        "1025 logit_bias entries",
        COMPLETION,
        {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}},
        "logit_bias",
        "array_above_max_length",
        "at most 1024 are allowed (--max-logit-bias)",
    ),
    (
        "chat top_logprobs 21",
        CHAT,
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "integer_above_max_value",
        "at most 20 are allowed (--max-top-logprobs)",
    ),
    (
        "completions logprobs 6",
        COMPLETION,
        {"prompt": "hi", "logprobs": 6},
        "logprobs",
        "integer_above_max_value",
        "at most 5 are allowed (OpenAI's limit for completions)",
    ),
    (
        "prompt_logprobs 21",
        COMPLETION,
        {"prompt": "hi", "prompt_logprobs": 21},
        "prompt_logprobs",
        "integer_above_max_value",
        "at most 20 are allowed (--max-top-logprobs)",
    ),
    (
        "generate top_logprobs_num 21",
        GENERATE,
        {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
        "top_logprobs_num",
        "integer_above_max_value",
        "at most 20 are allowed (--max-top-logprobs)",
    ),
]


@pytest.mark.parametrize(
    ("model", "body", "param", "code", "names"),
    [case[1:] for case in SIZE_LIMITS],
    ids=[case[0] for case in SIZE_LIMITS],
)
def test_sizes_past_the_default_limits_are_a_400_naming_the_limit_and_its_flag(
    model: type[BaseModel], body: dict[str, Any], param: str, code: str, names: str
) -> None:
    with pytest.raises(RequestError) as caught:
        to_sampling_params(model.model_validate(body), 1, **LIMITS)
    assert (caught.value.param, caught.value.code, caught.value.status) == (param, code, 400)
    assert names in caught.value.message


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (CHAT, {"messages": USER, "stop": ["x" * 1024] * 32, "logprobs": True, "top_logprobs": 20}),
        (
            COMPLETION,
            {"prompt": "hi", "logprobs": 5, "logit_bias": {str(i): 1 for i in range(1024)}},
        ),
        (GENERATE, {"text": "hi", "sampling_params": {"stop_token_ids": list(range(256))}}),
    ],
    ids=["chat", "completions", "generate"],
)
def test_sizes_at_the_default_limits_are_accepted(model: type[BaseModel], body: dict[str, Any]):
    to_sampling_params(model.model_validate(body), 1, **LIMITS)


def test_a_lower_max_top_logprobs_also_lowers_the_completions_limit() -> None:
    request = CompletionRequest.model_validate({"prompt": "hi", "logprobs": 4})
    with pytest.raises(RequestError, match=r"at most 3 are allowed \(--max-top-logprobs\)"):
        to_sampling_params(request, 1, **{**LIMITS, "limits": Settings(max_top_logprobs=3)})
