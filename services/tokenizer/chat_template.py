"""A conversation to prompt ids, by the model's own chat template, with tools.

The template sees OpenAI's messages as Hugging Face templates expect them: tool-call
arguments as objects, `developer` as `system` where the template has no such role, and the
tools under `tools`. A template that cannot render tools (the embedded SmolLM2's) gets them
as hermes-style text in the turns instead (`parsers.tool_render`), which the `hermes`
tool-call parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from services.tokenizer.adapters import RequestError
from services.tokenizer.openai_api import ChatCompletionMessageParam, ChatCompletionToolParam
from services.tokenizer.parsers.tool_parsers import tool_specs
from services.tokenizer.parsers.tool_render import messages_with_tools, template_supports_tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

THINK_START = "<think>"
THINK_END = "</think>"
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "continue_final_message",
        "chat_template",
        "return_dict",
        "return_tensors",
    }
)
"""Template arguments the request sets through its own fields, never through
`chat_template_kwargs`."""


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str

    @property
    def opens_reasoning(self) -> bool:
        """The template left the model inside a reasoning section (`<think>` opened, as
        DeepSeek-R1's does) rather than after a closed or skipped one."""
        return self.text.rstrip().endswith(THINK_START)

    @property
    def reasoning_closed(self) -> bool:
        """The template already closed the reasoning section (Qwen3 with
        `enable_thinking: false`): the model answers at once."""
        return self.text.rstrip().endswith(THINK_END)


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatCompletionMessageParam],
    *,
    tools: Sequence[ChatCompletionToolParam] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> ChatPrompt:
    """The prompt of a conversation, ending with the assistant's generation prompt (or
    inside its last message, with `continue_final_message`).

    The template is rendered to text and then encoded without special tokens added, because
    templates that start with a BOS token write it into the text themselves.
    """
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    kwargs = dict(template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise RequestError(
            f"chat_template_kwargs may not set {reserved}: the request's own fields do",
            param="chat_template_kwargs",
        )
    conversation = [_template_message(m, keep_developer="developer" in template) for m in messages]
    if (tools or any(m.tool_calls or m.role == "tool" for m in messages)) and not (
        template_supports_tools(template)
    ):
        specs = tool_specs([t.model_dump(exclude_none=True) for t in tools or ()])
        conversation = messages_with_tools(conversation, specs or None)
    elif tools:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise RequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from None
    assert isinstance(text, str), "tokenize=False renders text"
    return ChatPrompt(tokenizer.encode(text, add_special_tokens=False), text)


def _template_message(message: ChatCompletionMessageParam, keep_developer: bool) -> dict[str, Any]:
    role = "system" if message.role == "developer" and not keep_developer else message.role
    rendered: dict[str, Any] = {"role": role, "content": message.content or ""}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _arguments(call: Any) -> Any:
    """An earlier call's arguments as an object, as templates expect (`| tojson`); text
    that is not JSON stays text."""
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments
