"""A chat choice's text to reasoning, content and tool calls: the stream's pieces join to
exactly the unstreamed message, wherever the text is split."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from services.tokenizer.chat_output import (
    ChatMessageParts,
    ChatOutputFormat,
    ChatParsers,
    ChoiceParser,
    parse_whole,
)
from services.tokenizer.protocol.chat import ChatCompletionRequest

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_TEXT = (
    'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
THINKING = "<think>The user wants weather.</think>\n\n" + CALL_TEXT


def output_format(reasoning_parser: str | None = None, **fields: object) -> ChatOutputFormat:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], **fields}
    )
    return ChatOutputFormat.for_request(
        request,
        ChatParsers("hermes", reasoning_parser),
        starts_in_reasoning=False,
        reasoning_closed=False,
    )


def streamed(fmt: ChatOutputFormat, pieces: list[str]) -> tuple[ChatMessageParts, str]:
    """The message joined from a stream's deltas, each of which carries at most one piece
    per call (the openai SDK merges a call's pieces across chunks only)."""
    parser, parts = ChoiceParser(fmt), ChatMessageParts()
    for delta in [*(parser.feed(piece) for piece in pieces), parser.finish()]:
        indexes = [call.index for call in delta.tool_calls]
        assert len(indexes) == len(set(indexes))
        parts.add(delta)
    return parts, parser.finish_reason("stop")


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def calls(parts: ChatMessageParts) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in parts.tool_calls or ()]


def test_auto_tool_call_is_read_and_ends_with_tool_calls():
    parts, reason = parse_whole(output_format(), CALL_TEXT, "stop")
    assert calls(parts) == [("get_weather", '{"city":"Paris"}')]
    assert parts.content == "Let me look." and reason == "tool_calls"
    assert parts.tool_calls is not None and parts.tool_calls[0].id.startswith("call_")


def test_tool_choice_none_leaves_call_markup_as_content():
    parts, reason = parse_whole(output_format(tool_choice="none"), CALL_TEXT, "stop")
    assert parts.tool_calls is None and parts.content == CALL_TEXT and reason == "stop"


def test_named_function_output_is_its_arguments_and_ends_with_stop():
    fmt = output_format(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    parts, reason = parse_whole(fmt, '{"city": "Oslo"}', "stop")
    assert calls(parts) == [("get_weather", '{"city":"Oslo"}')] and reason == "stop"
    assert parts.content == ""


def test_required_output_cut_by_max_tokens_drops_the_unfinished_call():
    fmt = output_format(tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_wea'
    parts, reason = parse_whole(fmt, text, "length")
    assert calls(parts) == [("get_weather", '{"city":"Rome"}')] and reason == "length"


def test_reasoning_is_split_before_the_tools_are_read():
    parts, reason = parse_whole(output_format("qwen3"), THINKING, "stop")
    assert parts.reasoning == "The user wants weather."
    assert calls(parts) == [("get_weather", '{"city":"Paris"}')] and reason == "tool_calls"


@given(st.lists(st.integers(min_value=0), max_size=8))
def test_streamed_pieces_join_to_the_unstreamed_message(cuts: list[int]):
    for fmt, text in [
        (output_format(), CALL_TEXT),
        (output_format("qwen3"), THINKING),
        (
            output_format(tool_choice="required"),
            json.dumps([{"name": "get_weather", "parameters": {"city": "Nice"}}]),
        ),
    ]:
        whole, whole_reason = parse_whole(fmt, text, "stop")
        parts, reason = streamed(fmt, split(text, cuts))
        assert (parts.reasoning, parts.content, calls(parts), reason) == (
            whole.reasoning,
            whole.content,
            calls(whole),
            whole_reason,
        )
