"""Tools in the prompt: detecting templates that render them, and the hermes-style rewrite
for those that do not, rendered through the embedded SmolLM2 template."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

from transformers import PreTrainedTokenizerBase

from services.tokenizer.parsers import (
    get_tool_parser,
    messages_with_tools,
    render_tools_system_prompt,
    template_supports_tools,
    tool_specs,
)

OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
TOOLS = tool_specs(OPENAI_TOOLS)
TOOLS_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}TOOL {{ tool.function.name }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]


def test_template_support_is_detected(tokenizer: PreTrainedTokenizerBase) -> None:
    assert not template_supports_tools(tokenizer)
    assert template_supports_tools(TOOLS_TEMPLATE)
    assert template_supports_tools(
        SimpleNamespace(chat_template={"default": "x", "tool_use": TOOLS_TEMPLATE})
    )
    assert not template_supports_tools("{{ 'You have no tools.' }}{{ messages[0].content }}")
    assert not template_supports_tools(SimpleNamespace(chat_template=None))
    with_tools = copy.deepcopy(tokenizer)
    with_tools.chat_template = TOOLS_TEMPLATE
    assert template_supports_tools(with_tools)
    text = with_tools.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=OPENAI_TOOLS, tokenize=False
    )
    assert "TOOL get_weather\nTOOL get_time\n" in text


def test_template_with_transformers_tags_is_still_read() -> None:
    template = "{% generation %}{{ tools }}{% endgeneration %}"
    assert template_supports_tools(template)


def test_system_prompt_lists_the_schemas() -> None:
    prompt = render_tools_system_prompt(TOOLS)
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in listed] == OPENAI_TOOLS
    assert "<tool_call>\n" in prompt and '"arguments": <args-json-object>' in prompt


def test_messages_with_tools_rewrites_the_conversation() -> None:
    messages = messages_with_tools(CONVERSATION, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "Be brief.\n\n" + render_tools_system_prompt(TOOLS)
    assert messages[1] == CONVERSATION[1]
    assert messages[3]["content"] == (
        "<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n14:05\n</tool_response>"
    )
    calls = get_tool_parser("hermes").parse(messages[2]["content"], TOOLS)
    assert calls.content is None
    assert [(c.name, c.arguments) for c in calls.tool_calls] == [
        ("get_weather", '{"city":"Paris"}'),
        ("get_time", "{}"),
    ]
    assert CONVERSATION[0]["role"] == "developer"  # the input is left as it was


def test_messages_with_tools_keeps_assistant_text_and_adds_a_system_message() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": "not json"}}],
        },
        {"role": "tool", "content": "rain"},
        {"role": "user", "content": "Thanks"},
        {"role": "tool", "content": "late result"},
    ]
    out = messages_with_tools(messages, TOOLS)
    assert out[0] == {"role": "system", "content": render_tools_system_prompt(TOOLS)}
    assert out[2]["content"] == (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>'
    )
    assert [m["content"] for m in out[3:]] == [
        "<tool_response>\nrain\n</tool_response>",
        "Thanks",
        "<tool_response>\nlate result\n</tool_response>",
    ]


def test_no_tools_leaves_the_system_prompt_alone() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert messages_with_tools(messages, None) == messages
    assert messages_with_tools(messages, []) == messages


def test_rendered_through_the_smollm2_template(tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(
        messages_with_tools(CONVERSATION, TOOLS), add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "You are a helpful AI assistant named SmolLM" not in text
    assert json.dumps(OPENAI_TOOLS[0]) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n14:05\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
