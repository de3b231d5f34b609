"""A conversation to prompt ids, by the model's own chat template, with tools.

The template sees OpenAI's messages as Hugging Face templates expect them: tool-call
arguments as objects, `developer` as `system` where the template has no such role, and the
tools under `tools`. A template that cannot render tools (the embedded SmolLM2's) gets them
as hermes-style text in the turns instead (`parsers.tool_render`), which the `hermes`
tool-call parser reads back.

Only the template's own markup becomes control tokens: a special token written in the text
of a system, user or tool message, a tool definition or a template argument (where injected
documents and tool results arrive) is tokenized as the text it is, so `<|im_start|>system`
in a user message cannot forge a turn. Assistant content keeps the tokens the model emitted,
so that a conversation's history re-tokenizes to the ids the model produced (the radix
cache reuses it exactly). `--allow-special-tokens-in-content` parses them everywhere, as
before, for trusted callers.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from services.tokenizer.errors import RequestError
from services.tokenizer.parsers.tool_parsers import tool_specs
from services.tokenizer.parsers.tool_render import messages_with_tools, template_supports_tools
from services.tokenizer.protocol.chat import ChatCompletionMessageParam, ChatCompletionToolParam

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
TURN_END_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")
"""Tokens that close a turn: a chat answer stops on the one its template writes, even where
the model's EOS is another token (Gemma's base model ends text with `<eos>`)."""


def turn_end_ids(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The ids of the `TURN_END_TOKENS` the chat template writes and the vocabulary holds
    as single tokens."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in TURN_END_TOKENS if t in template]
    return tuple(i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id)


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
    special_tokens_in_content: bool = False,
) -> ChatPrompt:
    """The prompt of a conversation, ending with the assistant's generation prompt (or
    inside its last message, with `continue_final_message`).

    The template is rendered to text and then encoded without special tokens added, because
    templates that start with a BOS token write it into the text themselves. Control tokens
    in the caller's text become text (`ContentGuard`) unless `special_tokens_in_content`.
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
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools or ()]
    guard = None if special_tokens_in_content else ContentGuard(control_tokens(tokenizer))
    if guard is not None:
        conversation = [m if m["role"] == "assistant" else guard.mark(m) for m in conversation]
        tool_dicts, kwargs = guard.mark(tool_dicts), guard.mark(kwargs)
    if (tools or any(m.tool_calls or m.role == "tool" for m in messages)) and not (
        template_supports_tools(template)
    ):
        conversation = messages_with_tools(conversation, tool_specs(tool_dicts) or None)
    elif tools:
        kwargs["tools"] = tool_dicts
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
    if guard is None:
        return ChatPrompt(tokenizer.encode(text, add_special_tokens=False), text)
    return guard.encode(tokenizer, text)


@dataclass(frozen=True)
class ControlTokens:
    """A tokenizer's control tokens: its special tokens, and the other added tokens its chat
    template writes (Qwen's `<tool_call>`); whitespace tokens are ordinary text."""

    names: tuple[str, ...]
    pattern: re.Pattern[str]
    """Any of `names`, the longest first (a token before the tokens it contains)."""
    ids: dict[str, int]
    as_text: dict[str, list[int]]
    """Each token's ids as plain text (`<`, `|`, `im`, ... for `<|im_start|>`)."""


@functools.lru_cache(maxsize=8)
def control_tokens(tokenizer: PreTrainedTokenizerBase) -> ControlTokens:
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    ids = {
        token.content: token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special or (token.content in template and not token.content.isspace())
    }
    names = tuple(sorted(ids, key=len, reverse=True))
    pattern = re.compile("|".join(map(re.escape, names)) or "(?!)")  # (?!): never matches
    return ControlTokens(names, pattern, ids, {name: _text_ids(tokenizer, name) for name in names})


def _text_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """`text` tokenized as plain text in the middle of a prompt: encoded after a newline
    (then dropped), so that a SentencePiece tokenizer adds no word-start space to it."""
    newline = _plain_ids(tokenizer, "\n")
    ids = _plain_ids(tokenizer, "\n" + text)
    return ids[len(newline) :] if ids[: len(newline)] == newline else _plain_ids(tokenizer, text)


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The backend's pipeline without its added-token pass, which is what matches special
    tokens in text (`split_special_tokens` would only skip the special ones)."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    words = [text]
    if backend.pre_tokenizer is not None:
        words = [word for word, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [token.id for word in words for token in backend.model.tokenize(word)]


class ContentGuard:
    """One rendering's defence against control tokens in the caller's text.

    `mark` swaps each control token in a string for a sentinel that names it; the template
    cannot write one, since it holds a nonce drawn for this rendering. `encode` restores the
    tokens in the rendered text and tokenizes it whole, as without the guard, then replaces
    each restored token's id by the ids of its text. Ordinary content holds no control token,
    so its ids are exactly those of the text; next to a forged token the text is split where
    the parsed token splits it. Sentinels are ASCII letters and digits, so that JSON escaping
    (a template's `tojson`) leaves them whole."""

    def __init__(self, tokens: ControlTokens):
        self.tokens = tokens
        self.nonce = secrets.token_hex(8)
        self.sentinel = re.compile(f"{self.nonce}g(\\d+)g{self.nonce}")

    def mark(self, value: Any) -> Any:
        """`value` (a string, or lists and dicts of them; keys are left as they are) with
        each control token swapped for its sentinel."""
        if isinstance(value, str):
            return self.tokens.pattern.sub(self._sentinel, value)
        if isinstance(value, dict):
            return {key: self.mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.mark(item) for item in value]
        return value

    def _sentinel(self, match: re.Match[str]) -> str:
        return f"{self.nonce}g{self.tokens.names.index(match.group())}g{self.nonce}"

    def encode(self, tokenizer: PreTrainedTokenizerBase, rendered: str) -> ChatPrompt:
        if self.nonce not in rendered:
            return ChatPrompt(tokenizer.encode(rendered, add_special_tokens=False), rendered)
        pieces = self.sentinel.split(rendered)  # text, token index, text, ..., text
        parts: list[str] = []
        forged: list[tuple[int, int, str]] = []
        position = 0
        for i, piece in enumerate(pieces):
            if i % 2:
                piece = self.tokens.names[int(piece)]
                forged.append((position, position + len(piece), piece))
            parts.append(piece)
            position += len(piece)
        text = "".join(parts)
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = self._as_text(encoding["input_ids"], encoding["offset_mapping"], forged)
        return ChatPrompt(ids, text)

    def _as_text(
        self, ids: list[int], offsets: list[tuple[int, int]], forged: list[tuple[int, int, str]]
    ) -> list[int]:
        """`ids` with the token parsed at each forged span replaced by its text's ids."""
        out: list[int] = []
        done = 0
        for start, end, name in forged:
            i = bisect.bisect_left(offsets, start, key=lambda span: span[0])
            if (
                i < len(ids)
                and tuple(offsets[i]) == (start, end)
                and ids[i] == self.tokens.ids[name]
            ):
                out += ids[done:i]
                out += self.tokens.as_text[name]
                done = i + 1
        out += ids[done:]
        return out


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
