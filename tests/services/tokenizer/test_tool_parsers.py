"""The tool-call parsers on outputs as models write them, and the streaming property: the
streamed deltas, split anywhere, concatenate to the non-streaming result."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.parsers import (
    TOOL_PARSERS,
    ParsedToolCalls,
    StreamingToolParser,
    ToolCallDelta,
    ToolParser,
    ToolSpec,
    get_tool_parser,
    tool_specs,
)

OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
TOOLS = tool_specs(OPENAI_TOOLS)
CALL_ID = re.compile(r"^call_[0-9a-zA-Z]{24}$")


def calls(parsed: ParsedToolCalls) -> list[tuple[str, dict[str, object]]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def parse(parser: str, text: str) -> ParsedToolCalls:
    return get_tool_parser(parser).parse(text, TOOLS)


def test_tool_specs_reads_openai_tools() -> None:
    weather, time = TOOLS
    assert weather == ToolSpec(
        "get_weather", "The weather in a city.", OPENAI_TOOLS[0]["function"]["parameters"]
    )
    assert time == ToolSpec("get_time", None, None)
    assert time.parameters_schema() == {"type": "object"}


@pytest.mark.parametrize(
    "tools",
    [
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"description": "no name"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
        [{"type": "function", "function": {"name": "f"}}] * 2,
    ],
)
def test_tool_specs_rejects_other_shapes(tools: list[dict[str, object]]) -> None:
    with pytest.raises(ValueError, match=r"tools\[\d\]"):
        tool_specs(tools)


def test_registry_uses_vllm_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    assert get_tool_parser().name == "hermes"
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen25")


# hermes


def test_hermes_content_then_calls() -> None:
    text = (
        "I'll look up both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    parsed = parse("hermes", text)
    assert parsed.content == "I'll look up both."
    assert calls(parsed) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {}),
    ]
    assert parsed.tool_calls[0].arguments == '{"city":"Paris","unit":"celsius"}'
    ids = [call.id for call in parsed.tool_calls]
    assert all(CALL_ID.match(i) for i in ids) and len(set(ids)) == 2


def test_hermes_only_calls_has_no_content() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
    parsed = parse("hermes", text)
    assert parsed.content is None
    assert calls(parsed) == [("get_time", {})]


def test_hermes_plain_text_is_content_verbatim() -> None:
    text = "  Paris is sunny today.\n\n"
    assert parse("hermes", text) == ParsedToolCalls(text, [])


def test_hermes_text_on_both_sides_keeps_its_separating_whitespace() -> None:
    text = 'Checking.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.'
    parsed = parse("hermes", text)
    assert parsed.content == "Checking.\n\nDone."
    assert calls(parsed) == [("get_time", {})]


def test_hermes_malformed_and_unknown_blocks_stay_content() -> None:
    bad_json = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
    unknown = '<tool_call>\n{"name": "send_email", "arguments": {"to": "x"}}\n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    parsed = parse("hermes", f"{bad_json}\n{unknown}\n{good}")
    assert parsed.content == f"{bad_json}\n{unknown}"
    assert calls(parsed) == [("get_time", {})]


@pytest.mark.parametrize(
    "arguments",
    ['"not an object"', "[1, 2]", '{"x": NaN}', '"{\\"city\\": "'],
)
def test_hermes_arguments_that_are_no_strict_json_object_stay_content(arguments: str) -> None:
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    assert parse("hermes", text) == ParsedToolCalls(text, [])


def test_hermes_arguments_as_json_text_and_missing_arguments() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
        '<tool_call>{"name": "get_time"}</tool_call>'
    )
    assert calls(parse("hermes", text)) == [("get_weather", {"city": "Rome"}), ("get_time", {})]


def test_hermes_unclosed_last_block() -> None:
    """A model may stop before the closing tag; a complete call is still a call."""
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    parsed = parse("hermes", text)
    assert parsed.content == "Sure."
    assert parsed.tool_calls[0].arguments == '{"city":"Zürich"}'
    truncated = 'Sure.\n<tool_call>\n{"name": "get_weather", "argu'
    assert parse("hermes", truncated) == ParsedToolCalls(truncated, [])


def test_no_tools_offered_means_no_calls() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert get_tool_parser("hermes").parse(text, []) == ParsedToolCalls(text, [])


# llama3_json


def test_llama3_json_single_call_with_parameters_key() -> None:
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    parsed = parse("llama3_json", text)
    assert parsed.content is None
    assert calls(parsed) == [("get_weather", {"city": "Paris"})]


def test_llama3_json_python_tag_and_several_calls() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {}}\n'
    )
    assert calls(parse("llama3_json", text)) == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]


def test_llama3_json_content_before_python_tag() -> None:
    text = 'Let me check. <|python_tag|>{"name": "get_time", "parameters": {}}'
    parsed = parse("llama3_json", text)
    assert parsed.content == "Let me check."
    assert calls(parsed) == [("get_time", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "send_email"}',
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"answer": 42}',
        'Here is JSON: {"name": "get_time", "parameters": {}}',
        "<|python_tag|>brave_search.call(query='weather')",
    ],
)
def test_llama3_json_anything_else_is_content(text: str) -> None:
    assert parse("llama3_json", text) == ParsedToolCalls(text, [])


# mistral


def test_mistral_calls_after_content() -> None:
    text = (
        "Let me check the weather.[TOOL_CALLS] "
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    parsed = parse("mistral", text)
    assert parsed.content == "Let me check the weather."
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        '[TOOL_CALLS][{"name": "delete_files", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        "[TOOL_CALLS] I cannot call tools.",
        "[TOOL_CALLS][]",
        "A [link](https://example.com) [TOOL",
    ],
)
def test_mistral_invalid_calls_are_content(text: str) -> None:
    assert parse("mistral", text) == ParsedToolCalls(text, [])


# pythonic


def test_pythonic_list_of_calls() -> None:
    text = '[get_weather(city="Paris", unit="celsius"), get_time()]'
    parsed = parse("pythonic", text)
    assert parsed.content is None
    assert calls(parsed) == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {}),
    ]


def test_pythonic_literal_values_become_json() -> None:
    text = "[get_weather(city='Paris', days=(1, 2), opts={'hourly': True, 'x': None}, t=-1.5)]"
    assert parse("pythonic", text).tool_calls[0].arguments == (
        '{"city":"Paris","days":[1,2],"opts":{"hourly":true,"x":null},"t":-1.5}'
    )


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        "Call it like [get_time()].",
        '[get_weather("Paris")]',  # positional
        "[get_weather(city=__import__('os').getcwd())]",  # not a literal
        "[get_weather(city=x)]",
        "[get_weather(**kwargs)]",
        "[get_weather(city='a', city='b')]",
        "[get_weather(city={1, 2})]",  # a set has no JSON
        "[send_email(to='x')]",
        "[get_weather(city='Paris'), 42]",
        "[get_weather(city='Par",
        "[]",
    ],
)
def test_pythonic_anything_else_is_content(text: str) -> None:
    assert parse("pythonic", text) == ParsedToolCalls(text, [])


# streaming


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The concatenated content and the (name, arguments) per call of a streamed output,
    checking the shape of the call deltas on the way."""
    streaming = StreamingToolParser(parser, TOOLS)
    items = [item for piece in pieces for item in streaming.feed(piece)]
    items += streaming.finish()
    content = ""
    names: list[str] = []
    arguments: list[str] = []
    for item in items:
        if isinstance(item, str):
            assert item
            content += item
            continue
        assert isinstance(item, ToolCallDelta)
        if item.id is not None:
            assert item.index == len(names) and item.name is not None and item.arguments == ""
            assert CALL_ID.match(item.id)
            names.append(item.name)
            arguments.append("")
        else:
            assert item.index == len(names) - 1 and item.name is None
            arguments[item.index] += item.arguments
    return content, list(zip(names, arguments))


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def assert_stream_matches(parser_name: str, text: str, cuts: list[int]) -> None:
    parser = get_tool_parser(parser_name)
    parsed = parser.parse(text, TOOLS)
    content, streamed = stream(parser, split(text, cuts))
    assert content == (parsed.content or "")
    assert streamed == [(call.name, call.arguments) for call in parsed.tool_calls]


EXAMPLES = {
    "hermes": [
        'I\'ll check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        'A <tool_call>{"name": "nope", "arguments": {}}</tool_call> B <tool_call>{bad}'
        '</tool_call>\n<tool_call>{"name": "get_time"}</tool_call> C <tool_ca',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n',
        "No tools needed <tool here>. </tool_call>",
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        '  {"name": "get_time", "parameters": {}}\n',
        'Let me see. <|python_tag|>{"name": "get_time", "parameters": {}}',
        'Text <|python_ta and <|python_tag|>{"name": "nope"}',
        "<|python",
        "  ",
    ],
    "mistral": [
        'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}] Done.',
        '[TOOL_CALLS] oops [TOOL_CALLS][{"name": "get_time", "arguments": {}}][TOOL_CALLS] 12',
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "x"}][TOOL_CALLS]{"name"',
        "[TOOL_CALL [TOOL_CALLS]",
    ],
    "pythonic": [
        '[get_weather(city="Paris"), get_time()]',
        '\n [get_weather(city="Paris", days=[1, 2])]\n',
        "[get_weather(city=x)]",
        "The answer is [get_time()].",
        "",
    ],
}


@pytest.mark.parametrize(
    ("parser_name", "text"), [(name, text) for name, texts in EXAMPLES.items() for text in texts]
)
@given(data=st.data())
def test_streaming_matches_parse_for_any_split(
    parser_name: str, text: str, data: st.DataObject
) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_matches(parser_name, text, cuts)


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_streaming_character_by_character(parser_name: str) -> None:
    for text in EXAMPLES[parser_name]:
        assert_stream_matches(parser_name, text, list(range(len(text))))


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "[TOOL_CALLS]",
    "[TOOL_",
    "<|python_tag|>",
    "<|pyth",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_time", "parameters": {}}',
    '{"name": "nope", "arguments": {}}',
    '[{"name": "get_time", "arguments": {}}]',
    "[get_time()]",
    '[get_weather(city="Rome")]',
    "get_time()",
    "; ",
    ", ",
    "{",
    "}",
    "[",
    "]",
    " ",
    "\n",
    "Hello",
    "é",
    "12",
]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
@given(data=st.data())
def test_streaming_matches_parse_on_random_outputs(parser_name: str, data: st.DataObject) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=12)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert_stream_matches(parser_name, text, cuts)


def test_streaming_holds_back_a_possible_marker_only() -> None:
    streaming = StreamingToolParser(get_tool_parser("hermes"), TOOLS)
    assert streaming.feed("Hello <tool") == ["Hello"]
    assert streaming.feed("box> ") == [" <toolbox>"]
    assert streaming.feed("<tool_call>") == []
    block = '{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    head, arguments = streaming.feed(block)
    assert isinstance(head, ToolCallDelta) and isinstance(arguments, ToolCallDelta)
    assert (head.index, head.name, head.arguments) == (0, "get_weather", "")
    assert (arguments.index, arguments.id, arguments.name) == (0, None, None)
    assert arguments.arguments == '{"city":"Paris"}'
    assert streaming.finish() == []


def test_streaming_plain_text_flows_through() -> None:
    streaming = StreamingToolParser(get_tool_parser("llama3_json"), TOOLS)
    assert streaming.feed("  ") == []
    assert streaming.feed("The ") == ["  The"]
    assert streaming.feed("sky.") == [" sky."]
    assert streaming.finish() == []
