"""`/v1/responses` over chat: request translation, refusals, the Response object and the
event stream, each checked against the openai SDK's own types."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from services.tokenizer.errors import RequestError, validation_error_body
from services.tokenizer.protocol.chat import ChatCompletionChunk, ChatCompletionRequest
from services.tokenizer.protocol.responses import ResponsesRequest
from services.tokenizer.responses_output import ResponsesStream, to_response
from services.tokenizer.serving_responses import responses_error, to_chat_request
from services.tokenizer.sse import frame

MODEL = "smollm2"
RESPONSE_ID, CREATED = "resp_abc", 1_700_000_000
USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 8},
}
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": "hi", **fields})


def refusal(**fields: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        request(**fields)
    return info.value


# ------------------------------------------------------------------------------- requests


def test_a_string_input_is_one_user_message_after_the_instructions():
    body = to_chat_request(request(input="Hello", instructions="Be brief."))
    assert body == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
        ],
    }
    ChatCompletionRequest.model_validate(body)


def test_every_input_item_kind_becomes_its_chat_message():
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris"}]},
        # Copied back from an earlier response's output: its ids and annotations are ignored.
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "They want Paris."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"},
                    {"type": "input_text", "text": "wind"}]},
        {"type": "function_call", "call_id": "c3", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "fog"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
    ]  # fmt: skip
    call = lambda call_id, arguments: {  # noqa: E731
        "id": call_id,
        "type": "function",
        "function": {"name": "weather", "arguments": arguments},
    }
    body = to_chat_request(request(input=items))
    ChatCompletionRequest.model_validate(body)  # the chat endpoint takes it as it is
    assert body["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Paris"},
        # The reasoning is dropped; the calls join the assistant's text before them: one
        # chat turn, as it was answered.
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [call("c1", '{"city": "Paris"}'), call("c2", "{}")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain\nwind"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", "{}")]},
        {"role": "tool", "tool_call_id": "c3", "content": "fog"},
        {"role": "user", "content": "a\nb"},
    ]


def test_tools_and_tool_choice_take_chat_shapes():
    body = to_chat_request(
        request(
            tools=[WEATHER, {"type": "function", "name": "now"}],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
        )
    )
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    ChatCompletionRequest.model_validate(body)
    for mode in ("auto", "none", "required"):
        assert to_chat_request(request(tools=[WEATHER], tool_choice=mode))["tool_choice"] == mode
    assert "tools" not in to_chat_request(request()) and "tool_choice" not in to_chat_request(
        request()
    )


def test_sampling_stream_and_text_format_map_to_chat_fields():
    body = to_chat_request(
        request(max_output_tokens=64, temperature=0.5, top_p=0.9, stream=True, store=True)
    )
    assert body == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = {
        "text": None,
        "json_object": {"type": "json_object"},
        "json_schema": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    }
    for kind, expected in formats.items():
        fmt: dict[str, Any] = {"type": kind}
        if kind == "json_schema":
            fmt.update(name="a", schema=schema, strict=True)
        body = to_chat_request(request(text={"format": fmt}))
        assert body.get("response_format") == expected
        chat = ChatCompletionRequest.model_validate(body)
        assert chat.response_format is None or chat.response_format.grammar_schema() in (
            {"type": "object"},
            schema,
        )


@pytest.mark.parametrize(
    "fields",
    [
        {"store": False},
        {"store": True},
        {"background": False},
        {"include": []},
        {"reasoning": {"effort": None, "summary": None}},
        {"truncation": "disabled"},
        {"service_tier": "flex"},
        {"top_logprobs": 0},
        {"prompt_cache_retention": "in_memory"},
        {"stream_options": {"include_obfuscation": True}},
        {"tools": [{**WEATHER, "defer_loading": False, "allowed_callers": ["direct"]}]},
        {"frequency_penalty": 0.5},  # never heard of: ignored, as chat ignores such fields
        {"text": {"format": {"type": "text"}, "verbosity": "medium"}},
        {"metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "prompt_cache_key": "p"},
        {"previous_response_id": None, "tools": None, "max_tool_calls": 3},
    ],
)
def test_ignored_fields_and_defaults_of_unserved_ones_are_accepted(fields):
    to_chat_request(request(**fields))


@pytest.mark.parametrize("name", ["previous_response_id", "conversation"])
def test_state_is_refused_naming_the_field(name):
    err = refusal(**{name: "resp_1"})
    assert err.param == name and err.status == 400
    assert "stateless" in err.message and name in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"moderation": {"model": "m"}}, "moderation"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1].type"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
        ({"tools": [WEATHER, {**WEATHER, "output_schema": {}}]}, "tools[1].output_schema"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ],
)
def test_unimplemented_values_are_refused_naming_the_field(fields, param):
    err = refusal(**fields)
    assert err.param == param and param in err.message
    assert err.code == "unsupported_parameter" and err.status == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
         "input[0].call_id"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
         "tool_choice.name"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
    ],
)  # fmt: skip
def test_malformed_requests_name_the_field(fields, param):
    err = refusal(**fields)
    assert err.param == param and err.status == 400
    assert param in err.message


def test_a_top_level_type_error_is_a_validation_error_naming_the_field():
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate_json('{"input": "hi", "temperature": "hot"}')
    assert validation_error_body(info.value)["error"]["param"] == "temperature"


def test_chat_errors_come_back_in_the_responses_names():
    err = responses_error(
        RequestError("the prompt takes 10, but max_tokens is 99", param="max_tokens", code="c")
    )
    assert (err.message, err.param, err.code) == (
        "the prompt takes 10, but max_output_tokens is 99",
        "max_output_tokens",
        "c",
    )
    assert responses_error(RequestError("x", param="messages[3].content")).param == "input"
    assert responses_error(RequestError("x", param="tools[1].function.name")).param == (
        "tools[1].name"
    )
    assert responses_error(RequestError("x", param="response_format")).param == "text.format"


# ------------------------------------------------------------------------------ responses


def chat_answer(
    content: str | None = None,
    calls: Sequence[tuple[str, str, str]] = (),
    finish_reason: str = "stop",
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A chat.completion in OpenAI's shape; `calls` are (call_id, name, arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": CREATED,
        "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": USAGE,
    }


def test_a_text_answer_is_one_message_item_and_the_sdk_parses_it():
    req = request(instructions="Be brief.", metadata={"k": "v"})
    response = to_response(req, chat_answer("Hello there"), RESPONSE_ID, CREATED)
    parsed = Response.model_validate(response)
    assert parsed.status == "completed" and parsed.incomplete_details is None
    assert parsed.output_text == "Hello there"
    [item] = parsed.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "completed"
    assert parsed.usage is not None and parsed.usage.model_dump() == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 17,
    }
    assert (parsed.id, parsed.created_at, parsed.model) == (RESPONSE_ID, CREATED, MODEL)
    assert (parsed.instructions, parsed.metadata) == ("Be brief.", {"k": "v"})
    # Omitted parameters are echoed as applied: the engine's defaults, which are OpenAI's.
    assert (parsed.temperature, parsed.top_p, parsed.tool_choice) == (1.0, 1.0, "auto")
    assert parsed.parallel_tool_calls is True and parsed.tools == []
    assert response["store"] is False and parsed.previous_response_id is None


def test_tool_calls_are_function_call_items_after_the_text():
    req = request(tools=[WEATHER], tool_choice="required", temperature=0.2, max_output_tokens=50)
    calls = [("call_1", "weather", '{"city": "Paris"}'), ("call_2", "weather", "{}")]
    parsed = Response.model_validate(
        to_response(req, chat_answer("Checking.", calls, "tool_calls"), RESPONSE_ID, CREATED)
    )
    message, *function_calls = parsed.output
    assert message.type == "message"
    assert [(c.type, c.call_id, c.name, c.arguments, c.status) for c in function_calls] == [
        ("function_call", *call, "completed") for call in calls
    ]
    ids = [item.id for item in parsed.output]
    assert ids[1].startswith("fc_") and len(set(ids)) == 3
    assert parsed.tools[0].model_dump(exclude_none=True) == WEATHER
    assert (parsed.tool_choice, parsed.temperature, parsed.max_output_tokens) == (
        "required",
        0.2,
        50,
    )
    # Only calls, no text: no message item.
    only_calls = to_response(req, chat_answer(None, calls[:1], "tool_calls"), RESPONSE_ID, 0)
    assert [item["type"] for item in only_calls["output"]] == ["function_call"]


def test_reasoning_is_a_reasoning_item_first():
    answer = chat_answer("Paris.", [("c1", "weather", "{}")], "tool_calls", reasoning="Hmm.")
    parsed = Response.model_validate(to_response(request(), answer, RESPONSE_ID, CREATED))
    assert [item.type for item in parsed.output] == ["reasoning", "message", "function_call"]
    reasoning = parsed.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "Hmm.")]
    assert parsed.output_text == "Paris."
    usage = {**USAGE, "completion_tokens_details": {"reasoning_tokens": 3}}
    counted = to_response(request(), {**answer, "usage": usage}, RESPONSE_ID, CREATED)
    assert counted["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    # Sent back as input, the reasoning item is accepted and dropped.
    output = to_response(request(), answer, RESPONSE_ID, CREATED)["output"]
    again = request(input=[{"role": "user", "content": "hi"}, *output])
    assert [m["role"] for m in to_chat_request(again)["messages"]] == ["user", "assistant"]


def test_an_answer_cut_by_length_is_incomplete():
    response = to_response(request(), chat_answer("Hel", finish_reason="length"), RESPONSE_ID, 0)
    parsed = Response.model_validate(response)
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[0].status == "incomplete"


# ------------------------------------------------------------------------------ streaming


def chunks(
    texts: list[str],
    calls: list[tuple[str, str, list[str]]],
    finish_reason: str,
    reasoning: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """The chat.completion.chunk dicts OpenAI streams for text pieces, then whole calls
    ((call_id, name, argument pieces)), the finish reason and the usage."""

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": text}) for text in reasoning]
    out += [chunk({"content": text}) for text in texts]
    for index, (call_id, name, pieces) in enumerate(calls):
        first = {"index": index, "id": call_id, "type": "function",
                 "function": {"name": name, "arguments": ""}}  # fmt: skip
        out.append(chunk({"tool_calls": [first]}))
        out += [
            chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            for piece in pieces
        ]
    out.append(chunk({}, finish_reason))
    out.append({**chunk({}), "choices": [], "usage": USAGE})
    return out


def stream(req: ResponsesRequest, chat_chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of a whole stream, each checked against its SSE framing."""
    responses = ResponsesStream(req, RESPONSE_ID, CREATED, MODEL)
    events = responses.start()
    for c in chat_chunks:
        events += responses.feed(ChatCompletionChunk.model_validate(c))
    events += responses.finish()
    return [parse(frame([event])) for event in events]


def parse(event: str) -> dict[str, Any]:
    name, data, blank = event.split("\n", 2)
    assert name.startswith("event: ") and data.startswith("data: ") and blank == "\n"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["type"] == name.removeprefix("event: ")
    return payload


def check_events(events: list[dict[str, Any]]) -> None:
    """Every event parses as the SDK's; sequence numbers count up from 0; every event of an
    item points at the item added at its output_index, and at its one content part."""
    added: dict[int, str] = {}
    for n, event in enumerate(events):
        EVENTS.validate_python(event)
        assert event["sequence_number"] == n
        if event["type"] == "response.output_item.added":
            assert event["output_index"] == len(added)
            added[event["output_index"]] = event["item"]["id"]
        elif "item" in event:
            assert added[event["output_index"]] == event["item"]["id"]
        elif "item_id" in event:
            assert added[event["output_index"]] == event["item_id"]
            assert event.get("content_index", 0) == 0


def reassembled(events: list[dict[str, Any]]) -> dict[int, str]:
    """Per output_index, the text or arguments as the SDK's own stream accumulator builds
    them from the deltas (the `snapshot` of its last delta event)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    snapshots = {}
    for event in events:
        for handled in state.handle_event(EVENTS.validate_python(event)):
            if handled.type.endswith(".delta"):
                snapshots[handled.output_index] = handled.snapshot
    return snapshots


def test_a_text_stream_is_openais_event_sequence():
    req = request(stream=True)
    events = stream(req, chunks(["Hel", "lo", " there"], [], "stop"))
    check_events(events)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Hello there"
    assert events[-1]["response"] == to_response(
        req, chat_answer("Hello there"), RESPONSE_ID, CREATED
    )
    assert reassembled(events) == {0: "Hello there"}


def test_a_tool_call_stream_reassembles_to_the_whole_answer():
    req = request(tools=[WEATHER], stream=True)
    calls = [("call_1", "weather", ['{"ci', 'ty": ', '"Paris"}']), ("call_2", "weather", ["{}"])]
    events = stream(req, chunks(["Checking."], calls, "tool_calls"))
    check_events(events)
    whole = [(call_id, name, "".join(pieces)) for call_id, name, pieces in calls]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"] == to_response(
        req, chat_answer("Checking.", whole, "tool_calls"), RESPONSE_ID, CREATED
    )
    for index, (_, name, arguments) in enumerate(whole, start=1):
        deltas = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == index
        ]
        assert "".join(deltas) == arguments
        [done] = [
            e
            for e in events
            if e["type"] == "response.function_call_arguments.done" and e["output_index"] == index
        ]
        assert (done["name"], done["arguments"]) == (name, arguments)
    assert reassembled(events) == {0: "Checking.", 1: whole[0][2], 2: whole[1][2]}
    # Each item is done before the next is added.
    kinds = [e["type"] for e in events if e["type"].startswith("response.output_item")]
    assert kinds == ["response.output_item.added", "response.output_item.done"] * 3


def test_a_reasoning_stream_opens_with_a_reasoning_item():
    req = request(stream=True)
    events = stream(req, chunks(["Paris."], [], "stop", reasoning=["The user ", "wants Paris."]))
    check_events(events)
    reasoning = [e for e in events if e["type"].startswith("response.reasoning_text")]
    assert [e["type"] for e in reasoning] == [
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    ]
    assert reasoning[-1]["text"] == "The user wants Paris." and reasoning[-1]["output_index"] == 0
    assert events[-1]["response"] == to_response(
        req, chat_answer("Paris.", reasoning="The user wants Paris."), RESPONSE_ID, CREATED
    )


def test_a_stream_cut_by_length_ends_incomplete():
    req = request(stream=True)
    events = stream(req, chunks(["Hel"], [], "length"))
    check_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"] == to_response(
        req, chat_answer("Hel", finish_reason="length"), RESPONSE_ID, CREATED
    )


def test_a_stream_error_is_an_error_event_in_sequence():
    responses = ResponsesStream(request(stream=True), RESPONSE_ID, CREATED, MODEL)
    events = [parse(frame([e])) for e in responses.start()]
    events += [
        parse(frame([e])) for e in responses.error(RequestError("aborted", code="request_aborted"))
    ]
    check_events(events)
    assert events[-1] == {
        "type": "error",
        "sequence_number": 2,
        "code": "request_aborted",
        "message": "aborted",
        "param": None,
    }


def test_interleaved_tool_calls_are_refused_rather_than_misnumbered():
    responses = ResponsesStream(request(stream=True), RESPONSE_ID, CREATED, MODEL)
    [first, second, back] = [
        chunks([], [(f"c{i}", "f", ["{}"])], "tool_calls")[1] for i in range(3)
    ]
    second["choices"][0]["delta"]["tool_calls"][0]["index"] = 1
    responses.feed(ChatCompletionChunk.model_validate(first))
    responses.feed(ChatCompletionChunk.model_validate(second))
    with pytest.raises(ValueError, match="went back"):
        responses.feed(ChatCompletionChunk.model_validate(back))
