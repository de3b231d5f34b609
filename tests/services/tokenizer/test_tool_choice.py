"""Forced tool choice: the schemas accept exactly the outputs they should, and the calls read
back from a constrained output, whole or streamed, agree."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import xgrammar
from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.parsers import (
    StreamingForcedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    named_output,
    named_tool_schema,
    parse_required_output,
    required_tools_schema,
    tool_specs,
)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = tool_specs(
    [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
WEATHER, TIME = TOOLS


def valid(schema: dict[str, Any], value: object) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_named_tool_schema_is_the_parameters() -> None:
    assert named_tool_schema(WEATHER) == WEATHER_PARAMETERS
    assert named_tool_schema(TIME) == {"type": "object"}
    assert valid(named_tool_schema(WEATHER), {"city": "Paris", "days": 2})
    assert not valid(named_tool_schema(WEATHER), {"days": 2})
    assert not valid(named_tool_schema(TIME), [])


def test_named_tool_schema_is_a_copy() -> None:
    named_tool_schema(WEATHER)["required"] = []
    assert WEATHER.parameters == WEATHER_PARAMETERS


WEATHER_CALL = {"name": "get_weather", "parameters": {"city": "Paris"}}
TIME_CALL = {"name": "get_time", "parameters": {}}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_accepts_calls(parallel: bool) -> None:
    schema = required_tools_schema(TOOLS, parallel_tool_calls=parallel)
    assert valid(schema, [WEATHER_CALL])
    assert valid(schema, [TIME_CALL])
    assert valid(schema, [WEATHER_CALL, TIME_CALL]) is parallel


@pytest.mark.parametrize(
    "output",
    [
        [],
        WEATHER_CALL,
        [{"name": "send_email", "parameters": {}}],
        [{"name": "get_weather"}],
        [{"parameters": {"city": "Paris"}}],
        [{"name": "get_weather", "parameters": {"days": 2}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}],
        [{"name": "get_weather", "parameters": {"city": "Paris"}, "id": "x"}],
        [{"name": "get_time", "parameters": "now"}],
    ],
)
def test_required_schema_rejects_other_outputs(output: object) -> None:
    assert not valid(required_tools_schema(TOOLS, parallel_tool_calls=True), output)


def test_required_schema_needs_tools() -> None:
    with pytest.raises(ValueError, match="at least one tool"):
        required_tools_schema([], parallel_tool_calls=True)


def test_schemas_compile_to_grammars() -> None:
    """The grammar backend takes them as they are."""
    for schema in (
        named_tool_schema(WEATHER),
        required_tools_schema(TOOLS, parallel_tool_calls=False),
        required_tools_schema(TOOLS, parallel_tool_calls=True),
    ):
        xgrammar.Grammar.from_json_schema(json.dumps(schema))


def test_parse_required_output() -> None:
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Zürich", "days": 3}},\n'
        ' {"name": "get_time", "parameters": {}}]'
    )
    calls = parse_required_output(text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Zürich","days":3}'),
        ("get_time", "{}"),
    ]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[{"name": "get_weather", "parameters": {"city": "Par', "max_tokens"),
        ('[{"name": "get_time", "parameters": {}}', "max_tokens"),
        ("", "max_tokens"),
        ("[]", "JSON object"),
        ('{"name": "get_time", "parameters": {}}', "list"),
        ('[{"name": "send_email", "parameters": {}}]', "send_email"),
        ('[{"name": "get_time"}]', "parameters"),
        ('[{"name": "get_time", "parameters": {"x": NaN}}]', "strict JSON"),
        ('[{"name": "get_time", "parameters": {}} {"name": "get_time"}]', "','"),
        ('[{"name": "get_time", "parameters": {}}] trailing', "after"),
    ],
)
def test_parse_required_output_rejects_invalid_text(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_required_output(text, TOOLS)


def test_named_output() -> None:
    call = named_output(' {"city": "Paris",\n "days": 2} ', WEATHER)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris","days":2}')


@pytest.mark.parametrize(
    ("text", "error"),
    [('{"city": "Par', "max_tokens"), ('["Paris"]', "JSON object"), ("{} {}", "after")],
)
def test_named_output_rejects_invalid_text(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        named_output(text, WEATHER)


def streamed(stream: StreamingForcedToolCalls, pieces: list[str]) -> list[tuple[str, str]]:
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    calls: list[tuple[str, str]] = []
    for delta in deltas:
        if delta.id is not None:
            assert delta.index == len(calls) and delta.name and delta.arguments == ""
            calls.append((delta.name, ""))
        else:
            name, arguments = calls[delta.index]
            calls[delta.index] = (name, arguments + delta.arguments)
    return calls


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def pairs(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


REQUIRED_TEXT = (
    ' [ {"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\"", "days": 1}} ,'
    '{"name":"get_time","parameters":{}}]\n'
)


@given(cuts=st.lists(st.integers(0, len(REQUIRED_TEXT)), max_size=15))
def test_streaming_required_matches_parse(cuts: list[int]) -> None:
    stream = StreamingForcedToolCalls.for_required(TOOLS)
    assert streamed(stream, pieces_of(REQUIRED_TEXT, cuts)) == pairs(
        parse_required_output(REQUIRED_TEXT, TOOLS)
    )
    assert pairs(stream.calls) == pairs(parse_required_output(REQUIRED_TEXT, TOOLS))


NAMED_TEXT = '{"city": "{[Paris]}", "days": 4}'


@given(cuts=st.lists(st.integers(0, len(NAMED_TEXT)), max_size=10))
def test_streaming_named_matches_parse(cuts: list[int]) -> None:
    stream = StreamingForcedToolCalls.for_named(WEATHER)
    expected = named_output(NAMED_TEXT, WEATHER)
    assert streamed(stream, pieces_of(NAMED_TEXT, cuts)) == [(expected.name, expected.arguments)]


def test_streaming_required_emits_each_call_once_complete() -> None:
    stream = StreamingForcedToolCalls.for_required(TOOLS)
    assert stream.feed('[{"name": "get_time", "parameters": {') == []
    head, arguments = stream.feed("}}, ")
    assert head == ToolCallDelta(0, stream.calls[0].id, "get_time", "")
    assert arguments == ToolCallDelta(0, None, None, "{}")
    assert stream.feed('{"name": "get_weather", "parameters": {"city": "Rome"}}') != []
    with pytest.raises(ValueError, match="max_tokens"):
        stream.finish()  # the list never closed


def test_tool_spec_without_parameters_accepts_any_object() -> None:
    spec = ToolSpec("ping")
    assert pairs([named_output("{}", spec)]) == [("ping", "{}")]
    assert named_output('{"a": [1]}', spec).arguments == '{"a":[1]}'


def test_required_schema_lifts_each_tools_defs_to_the_root() -> None:
    """`#/$defs/...` is resolved from the root of the schema, so a tool's definitions (what
    a nested pydantic model's schema has) move there, named after the tool."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [
        ToolSpec(
            name,
            parameters={
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/Point"}},
                "required": ["at"],
                "$defs": {"Point": point},
            },
        )
        for name in ("move", "look")
    ]
    schema = required_tools_schema(tools, parallel_tool_calls=True)
    assert set(schema["$defs"]) == {"move.Point", "look.Point"}
    xgrammar.Grammar.from_json_schema(json.dumps(schema))
    jsonschema.validate([{"name": "move", "parameters": {"at": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "look", "parameters": {"at": {"x": "1"}}}], schema)
