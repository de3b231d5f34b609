"""Tools in the prompt, for chat templates that do not render them.

A template that references `tools` gets the request's tools from `apply_chat_template`
itself. For one that does not (the embedded SmolLM2's), the conversation is rewritten into
plain system, user and assistant text in the hermes style of Qwen2.5's template: the tools'
schemas in `<tools></tools>` in the system message, earlier calls as `<tool_call>` blocks
and their results as `<tool_response>` blocks in a user turn. The `hermes` tool parser reads
calls in that form back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.meta

from services.tokenizer.parsers.tool_parsers import ToolSpec


def template_supports_tools(tokenizer_or_template: object) -> bool:
    """Whether a chat template (the text, or a tokenizer's `chat_template`, which may be a
    dict of named templates) reads the `tools` variable."""
    template = (
        tokenizer_or_template
        if isinstance(tokenizer_or_template, str)
        else getattr(tokenizer_or_template, "chat_template", None)
    )
    if isinstance(template, dict):
        return any(_reads_tools(text) for text in template.values() if isinstance(text, str))
    return isinstance(template, str) and _reads_tools(template)


def _reads_tools(template: str) -> bool:
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateSyntaxError:
        # Tags of transformers' own (such as {% generation %}) fail a plain parse.
        return re.search(r"\btools\b", template) is not None


def _tool_json(tool: ToolSpec) -> str:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def render_tools_system_prompt(tools: Sequence[ToolSpec]) -> str:
    """The system-prompt text that offers `tools`, worded as Qwen2.5's template words it."""
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(_tool_json(tool) for tool in tools)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _text(content: object) -> str:
    """A message's content as text: None is empty, and of a list of parts the text parts
    count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    raise ValueError(f"message content must be text or a list of parts, not {content!r}")


def _tool_call_block(call: dict[str, Any]) -> str:
    """A call of an assistant message in the form the model writes it; the arguments, JSON
    text in OpenAI's messages, are embedded as the object they encode."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: embedded as the string it is, as Qwen's template would
    call_json = json.dumps(
        {"name": function.get("name"), "arguments": arguments}, ensure_ascii=False
    )
    return f"<tool_call>\n{call_json}\n</tool_call>"


def messages_with_tools(
    messages: list[dict[str, Any]], tools: Sequence[ToolSpec] | None
) -> list[dict[str, Any]]:
    """`messages` rewritten for a template without tool support: the tools' prompt merged
    into the first system message (or a new one), assistant `tool_calls` written into the
    content, consecutive `tool` results joined into one user turn, `developer` as `system`.
    Other messages pass unchanged."""
    out: list[dict[str, Any]] = []
    merging_results = False  # whether out[-1] is a user turn of tool results
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if merging_results:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            merging_results = True
            continue
        merging_results = False
        if role == "assistant" and message.get("tool_calls"):
            content = _text(message.get("content"))
            blocks = [_tool_call_block(call) for call in message["tool_calls"]]
            out.append(
                {
                    "role": "assistant",
                    "content": "\n".join([content, *blocks] if content else blocks),
                }
            )
        else:
            out.append({**message, "role": "system"} if role == "developer" else dict(message))
    if tools:
        prompt = render_tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            system = _text(out[0].get("content"))
            out[0] = {**out[0], "content": f"{system}\n\n{prompt}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
