"""Tool-call parsers: they find the function calls a model wrote in its output text, in the
format of its family, and split them from the rest, which is the message's content.

Names follow vLLM's `--tool-call-parser`: `hermes` (Qwen2.5, Hermes), `llama3_json`,
`mistral` and `pythonic`. A call that names a function the request did not offer, or whose
arguments do not parse, stays in the content as the model wrote it: the client sees what
the model said rather than an error.

Streaming and non-streaming share one scanner per format, so the streamed deltas concatenate
to exactly what `ToolParser.parse` returns. The streaming side keeps back text that may be
the start of a call, and a call until it is complete; then it sends the call's name and its
whole arguments at once.
"""

from __future__ import annotations

import ast
import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

from services.tokenizer.parsers._text import compact_json, held_back, skip_json_whitespace
from services.tool_parser_names import DEFAULT_TOOL_PARSER

_DECODER = json.JSONDecoder()


def new_tool_call_id() -> str:
    """A fresh id in OpenAI's form: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSpec:
    """A function the request offers the model; `parameters` is its JSON schema, None where
    the request gave none."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The schema the arguments must satisfy: with none given, any object."""
        return dict(self.parameters) if self.parameters is not None else {"type": "object"}


def tool_specs(tools: Sequence[Mapping[str, Any]]) -> list[ToolSpec]:
    """The functions of a request's `tools`, in OpenAI's shape
    (`{"type": "function", "function": {"name", "description", "parameters"}}`, as a request
    model's `model_dump()` gives them). Raises ValueError on any other shape or on a name
    offered twice, which would make a call ambiguous."""
    specs: list[ToolSpec] = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise ValueError(f"tools[{i}] is not a function tool")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if any(spec.name == name for spec in specs):
            raise ValueError(f"tools[{i}]: the function name {name!r} is offered twice")
        description = function.get("description")
        specs.append(
            ToolSpec(
                name=name,
                description=description if isinstance(description, str) else None,
                parameters=dict(parameters) if parameters is not None else None,
            )
        )
    return specs


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `arguments` is compact, strict JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """A whole output split into its content (None where nothing is left) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of the call at `index`, as OpenAI's `delta.tool_calls[]`: the first
    piece of a call carries its id and name (its type is then "function") and empty
    arguments; the next ones carry only arguments text."""

    index: int
    id: str | None
    name: str | None
    arguments: str


ToolStreamItem: TypeAlias = str | ToolCallDelta
"""What a streaming parser emits, in output order: content text, or a piece of a call."""


@dataclass(frozen=True)
class _FunctionCall:
    name: str
    arguments: str


_Segment: TypeAlias = str | list[_FunctionCall]
"""A scanned stretch of output: text, or the calls of one valid block."""


def _function_call(value: object, names: frozenset[str]) -> _FunctionCall | None:
    """The call a decoded `{"name": ..., "arguments"|"parameters": {...}}` makes, or None
    where it names an unknown function or its arguments are no object. Arguments given as
    JSON text, as some models write them, are decoded; absent ones are empty."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    compact = compact_json(arguments)
    return None if compact is None else _FunctionCall(name, compact)


def _function_calls(values: list[Any], names: frozenset[str]) -> list[_FunctionCall] | None:
    """The calls of a block that lists several, or None unless all of them are valid: a
    block is a call list or content as a whole."""
    calls = [_function_call(value, names) for value in values]
    if not calls or any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


class _Scanner(ABC):
    """Splits output text into segments as it arrives; one per output, since some formats
    keep state (whether the output has already turned out to be plain content)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    @abstractmethod
    def scan(self, buffer: str, final: bool) -> tuple[list[_Segment], int]:
        """The segments that `buffer` (the text not consumed yet) settles, and how many of its
        characters they consume. With `final`, the output ends with `buffer`: all of it must
        be consumed."""


class _MarkerScanner(_Scanner):
    """Formats where a call block starts with a marker anywhere in the output."""

    marker: ClassVar[str]

    def scan(self, buffer: str, final: bool) -> tuple[list[_Segment], int]:
        segments: list[_Segment] = []
        pos = 0
        while True:
            start = buffer.find(self.marker, pos)
            if start < 0:
                end = len(buffer)
                if not final:
                    end -= min(held_back(buffer, self.marker), len(buffer) - pos)
                segments.append(buffer[pos:end])
                return segments, end
            segments.append(buffer[pos:start])
            block = self._block(buffer, start + len(self.marker), final)
            if block is None:
                return segments, start
            calls, pos = block
            segments.append(calls if calls is not None else buffer[start:pos])

    @abstractmethod
    def _block(
        self, buffer: str, body: int, final: bool
    ) -> tuple[list[_FunctionCall] | None, int] | None:
        """For the block whose body starts at `body`: its calls (None where they are not
        valid) and where it ends; None while the block may still be incomplete."""


class _HermesScanner(_MarkerScanner):
    marker = "<tool_call>"
    close = "</tool_call>"

    def _block(
        self, buffer: str, body: int, final: bool
    ) -> tuple[list[_FunctionCall] | None, int] | None:
        close = buffer.find(self.close, body)
        if close < 0:
            # A model can stop before the closing tag: at the end, take what it wrote.
            return (self._decode(buffer[body:]), len(buffer)) if final else None
        return self._decode(buffer[body:close]), close + len(self.close)

    def _decode(self, body: str) -> list[_FunctionCall] | None:
        try:
            call = _function_call(json.loads(body), self.names)
        except (ValueError, RecursionError):
            return None
        return None if call is None else [call]


class _MistralScanner(_MarkerScanner):
    marker = "[TOOL_CALLS]"

    def _block(
        self, buffer: str, body: int, final: bool
    ) -> tuple[list[_FunctionCall] | None, int] | None:
        start = skip_json_whitespace(buffer, body)
        if start == len(buffer):
            return (None, start) if final else None
        if buffer[start] not in "[{":
            return None, body  # no JSON call list follows: the marker alone is content
        try:
            value, end = _DECODER.raw_decode(buffer, start)
        except (ValueError, RecursionError):
            # An incomplete list, or a malformed one: only the end tells which.
            return (None, len(buffer)) if final else None
        return _function_calls(value if isinstance(value, list) else [value], self.names), end


class _LeadingScanner(_Scanner):
    """Formats where the calls are the whole output, told apart by how it starts: the
    scanner keeps an output that may be calls until its end, and passes any other on as
    content."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self._content = False

    def scan(self, buffer: str, final: bool) -> tuple[list[_Segment], int]:
        if not self._content:
            head = buffer.lstrip()
            if self._may_start_calls(head):
                if not final:
                    return [], 0
                calls = self._calls(buffer)
                return [calls if calls is not None else buffer], len(buffer)
            self._content = True
        return self._scan_content(buffer, final)

    @abstractmethod
    def _may_start_calls(self, head: str) -> bool:
        """Whether an output that starts with `head` (whitespace skipped) may be calls."""

    @abstractmethod
    def _calls(self, text: str) -> list[_FunctionCall] | None:
        """The calls `text` makes as a whole, or None."""

    def _scan_content(self, buffer: str, final: bool) -> tuple[list[_Segment], int]:
        return [buffer], len(buffer)


class _Llama3JsonScanner(_LeadingScanner):
    tag = "<|python_tag|>"

    def _may_start_calls(self, head: str) -> bool:
        return head.startswith(("{", self.tag)) or self.tag.startswith(head)

    def _scan_content(self, buffer: str, final: bool) -> tuple[list[_Segment], int]:
        """Content may still lead to calls after the python tag."""
        tag = buffer.find(self.tag)
        if tag < 0:
            end = len(buffer) if final else len(buffer) - held_back(buffer, self.tag)
            return [buffer[:end]], end
        if not final:
            return [buffer[:tag]], tag
        calls = self._calls(buffer[tag:])
        return [buffer[:tag], calls if calls is not None else buffer[tag:]], len(buffer)

    def _calls(self, text: str) -> list[_FunctionCall] | None:
        """`[<|python_tag|>] {...} [; {...}]...`, the JSON objects `;`-separated."""
        text = text.lstrip()
        pos = len(self.tag) if text.startswith(self.tag) else 0
        values: list[Any] = []
        while True:
            try:
                value, pos = _DECODER.raw_decode(text, skip_json_whitespace(text, pos))
            except (ValueError, RecursionError):
                return None
            values.append(value)
            pos = skip_json_whitespace(text, pos)
            if pos == len(text):
                return _function_calls(values, self.names)
            if text[pos] != ";":
                return None
            pos += 1


class _PythonicScanner(_LeadingScanner):
    def _may_start_calls(self, head: str) -> bool:
        return head.startswith("[") or not head

    def _calls(self, text: str) -> list[_FunctionCall] | None:
        """`[f(a=1), g(b="x")]`: a Python list of calls with keyword arguments whose values
        are literals, read with `ast`, never evaluated."""
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                return None
            if node.func.id not in self.names or node.args:
                return None
            arguments: dict[str, Any] = {}
            for keyword in node.keywords:
                if keyword.arg is None or keyword.arg in arguments:
                    return None
                try:
                    arguments[keyword.arg] = ast.literal_eval(keyword.value)
                except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                    return None
            compact = compact_json(arguments)
            if compact is None:
                return None
            calls.append(_FunctionCall(node.func.id, compact))
        return calls


class _Assembler:
    """Turns segments into content text and calls. The whitespace that only separates calls
    from the start or the end of the content is dropped (models put newlines around their
    call blocks); all other content is kept as written. Trailing whitespace is therefore held
    until what follows it is known."""

    def __init__(self) -> None:
        self._pending = ""
        self._content_seen = False
        self._call_since_content = False

    def push(self, segments: list[_Segment]) -> list[str | _FunctionCall]:
        out: list[str | _FunctionCall] = []
        for segment in segments:
            if not isinstance(segment, str):
                self._call_since_content = True
                out.extend(segment)
                continue
            body = segment.strip()
            if not body:
                self._pending += segment
                continue
            lead = len(segment) - len(segment.lstrip())
            self._pending += segment[:lead]
            if self._content_seen or not self._call_since_content:
                out.append(self._pending)
            out.append(segment[lead : lead + len(body)])
            self._pending = segment[lead + len(body) :]
            self._content_seen, self._call_since_content = True, False
        return out

    def finish(self) -> list[str | _FunctionCall]:
        return [] if self._call_since_content else [self._pending]


class ToolParser(ABC):
    """A model family's tool-call format. Stateless: one instance serves every request."""

    name: ClassVar[str]

    @abstractmethod
    def _scanner(self, names: frozenset[str]) -> _Scanner:
        """A scanner for one output, accepting calls to `names`."""

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedToolCalls:
        """A whole output's content and the calls it makes to `tools`."""
        segments, _ = self._scanner(frozenset(t.name for t in tools)).scan(text, final=True)
        assembler = _Assembler()
        items = assembler.push(segments) + assembler.finish()
        content = "".join(item for item in items if isinstance(item, str))
        calls = [
            ToolCall(new_tool_call_id(), item.name, item.arguments)
            for item in items
            if isinstance(item, _FunctionCall)
        ]
        return ParsedToolCalls(content or None, calls)


class StreamingToolParser:
    """Parses one choice's output as it streams: `feed` each text delta, then `finish` once
    the output ends. Both return the content deltas and call deltas now settled, in output
    order, adjacent content merged."""

    def __init__(self, parser: ToolParser, tools: Sequence[ToolSpec]) -> None:
        self._scanner = parser._scanner(frozenset(t.name for t in tools))
        self._assembler = _Assembler()
        self._buffer = ""
        self._calls = 0

    def feed(self, delta: str) -> list[ToolStreamItem]:
        self._buffer += delta
        segments, consumed = self._scanner.scan(self._buffer, final=False)
        self._buffer = self._buffer[consumed:]
        return self._deltas(self._assembler.push(segments))

    def finish(self) -> list[ToolStreamItem]:
        segments, _ = self._scanner.scan(self._buffer, final=True)
        self._buffer = ""
        return self._deltas(self._assembler.push(segments) + self._assembler.finish())

    def _deltas(self, items: list[str | _FunctionCall]) -> list[ToolStreamItem]:
        out: list[ToolStreamItem] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    continue
                if out and isinstance(out[-1], str):
                    out[-1] += item
                else:
                    out.append(item)
                continue
            out.append(ToolCallDelta(self._calls, new_tool_call_id(), item.name, ""))
            out.append(ToolCallDelta(self._calls, None, None, item.arguments))
            self._calls += 1
        return out


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks anywhere in the
    output (Qwen2.5, Hermes); each block is a call or content on its own."""

    name = "hermes"

    def _scanner(self, names: frozenset[str]) -> _Scanner:
        return _HermesScanner(names)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x's JSON tool calling: an output that is, after an optional `<|python_tag|>`,
    one `{"name": ..., "parameters": {...}}` object or several joined by `;`. Text before
    the python tag is content; an output that starts with `{` is calls or content as a
    whole, so it streams only once it ends."""

    name = "llama3_json"

    def _scanner(self, names: frozenset[str]) -> _Scanner:
        return _Llama3JsonScanner(names)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}` (Mistral's
    pre-v11 tokenizers); text around it is content."""

    name = "mistral"

    def _scanner(self, names: frozenset[str]) -> _Scanner:
        return _MistralScanner(names)


class PythonicToolParser(ToolParser):
    """An output that is a Python list of calls, `[get_weather(city="Paris"), f(x=1)]`
    (Llama 3.2, ToolACE): keyword arguments with literal values only. An output that starts
    with `[` streams only once it ends."""

    name = "pythonic"

    def _scanner(self, names: frozenset[str]) -> _Scanner:
        return _PythonicScanner(names)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str = DEFAULT_TOOL_PARSER) -> ToolParser:
    """The parser registered as `name`; ValueError, naming the known ones, otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}") from None
