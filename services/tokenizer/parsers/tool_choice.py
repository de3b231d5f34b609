"""What `tool_choice` forces: the JSON schema the output is constrained to, and the calls
read back from the constrained output.

A named function (`{"type": "function", "function": {"name": ...}}`) constrains the output
to that function's arguments object. `"required"` constrains it, as vLLM does, to a JSON
list of `{"name": ..., "parameters": {...}}` items, one or more (exactly one without
parallel tool calls). The output can still be invalid where generation stopped early, at
`max_tokens`: reading it then raises ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.tokenizer.parsers._text import compact_json, skip_json_whitespace
from services.tokenizer.parsers.tool_parsers import (
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    new_tool_call_id,
)

_DECODER = json.JSONDecoder()


def named_tool_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema of the output when `tool` is forced: its arguments."""
    return tool.parameters_schema()


def required_tools_schema(tools: Sequence[ToolSpec], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of the output under `tool_choice: "required"`: a list of calls, each to
    one of `tools` with arguments that satisfy that tool's parameters. Each tool's `$defs`
    move to the root, where `#/$defs/...` references are resolved, named after the tool."""
    if not tools:
        raise ValueError('tool_choice "required" needs at least one tool')
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        parameters, tool_defs = _hoisted_defs(tool.parameters_schema(), tool.name)
        defs.update(tool_defs)
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": tool.name},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_DEFS_KEYS = ("$defs", "definitions")


def _hoisted_defs(schema: dict[str, Any], tool: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`schema` without its definitions, its references renamed to `#/$defs/<tool>.<name>`,
    and those definitions under their new names."""
    renames = {
        f"#/{key}/{name}": f"#/$defs/{tool}.{name}"
        for key in _DEFS_KEYS
        for name in schema.get(key) or {}
    }

    def renamed(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: renames.get(v, v) if k == "$ref" and isinstance(v, str) else renamed(v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [renamed(v) for v in value]
        return value

    defs = {
        f"{tool}.{name}": renamed(definition)
        for key in _DEFS_KEYS
        for name, definition in (schema.get(key) or {}).items()
    }
    return renamed({k: v for k, v in schema.items() if k not in _DEFS_KEYS}), defs


class StreamingForcedToolCalls:
    """Reads a forced output as it streams, emitting each call once its JSON object is
    complete: first its id and name with empty arguments, then its whole arguments. `feed`
    and `finish` raise ValueError as soon as the text cannot be a valid output."""

    def __init__(self, tools: Sequence[ToolSpec], named: ToolSpec | None) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._named = named
        self._buffer = ""
        self._state = "start"
        self.calls: list[ToolCall] = []
        """The calls emitted so far."""

    @classmethod
    def for_named(cls, tool: ToolSpec) -> StreamingForcedToolCalls:
        """For an output that is `tool`'s arguments object."""
        return cls([tool], named=tool)

    @classmethod
    def for_required(cls, tools: Sequence[ToolSpec]) -> StreamingForcedToolCalls:
        """For an output that is a list of calls to `tools`."""
        return cls(tools, named=None)

    def feed(self, delta: str) -> list[ToolCallDelta]:
        self._buffer += delta
        return self._scan(final=False)

    def finish(self) -> list[ToolCallDelta]:
        deltas = self._scan(final=True)
        if self._state != "done":
            raise ValueError(
                "the output ends before its tool calls are complete "
                "(generation may have stopped at max_tokens)"
            )
        return deltas

    def _scan(self, final: bool) -> list[ToolCallDelta]:
        """Consumes what the buffer settles: the states are `start` (before the list or the
        object), `item` (before a list item), `after` (after one) and `done`."""
        deltas: list[ToolCallDelta] = []
        while True:
            pos = skip_json_whitespace(self._buffer, 0)
            self._buffer = self._buffer[pos:]
            if not self._buffer:
                return deltas
            char = self._buffer[0]
            if self._state == "done":
                raise ValueError(f"unexpected text after the tool calls: {self._buffer[:20]!r}")
            if self._state == "start" and self._named is None:
                if char != "[":
                    raise ValueError('the output is not a JSON list of tool calls (no "[")')
                self._buffer, self._state = self._buffer[1:], "item"
            elif self._state == "after":
                if char not in ",]":
                    raise ValueError(f"expected ',' or ']' between tool calls, got {char!r}")
                self._buffer = self._buffer[1:]
                self._state = "item" if char == "," else "done"
            else:
                value = self._object(final)
                if value is None:
                    return deltas
                call = self._call(value)
                deltas += [
                    ToolCallDelta(len(self.calls), call.id, call.name, ""),
                    ToolCallDelta(len(self.calls), None, None, call.arguments),
                ]
                self.calls.append(call)
                self._state = "done" if self._named is not None else "after"

    def _object(self, final: bool) -> Any:
        """The JSON object the buffer starts with, consumed; None while it is incomplete."""
        if self._buffer[0] != "{":
            what = "tool call" if self._named is None else "arguments"
            raise ValueError(f"expected a JSON object for the {what}, got {self._buffer[:20]!r}")
        try:
            value, end = _DECODER.raw_decode(self._buffer)
        except (ValueError, RecursionError):
            # Incomplete, or malformed: only the end of the output tells which.
            if final:
                raise ValueError(
                    "the output is not valid JSON (generation may have stopped at max_tokens)"
                ) from None
            return None
        self._buffer = self._buffer[end:]
        return value

    def _call(self, value: dict[str, Any]) -> ToolCall:
        """The call an object makes: the forced function's arguments, or a list item."""
        if self._named is not None:
            name, arguments = self._named.name, value
        else:
            item_name, item_arguments = value.get("name"), value.get("parameters")
            if not isinstance(item_name, str) or item_name not in self._tools:
                raise ValueError(f"the tool call names no offered function: {item_name!r}")
            if not isinstance(item_arguments, dict):
                raise ValueError(f"the call to {item_name!r} has no parameters object")
            name, arguments = item_name, item_arguments
        compact = compact_json(arguments)
        if compact is None:
            raise ValueError(f"the arguments of {name!r} are not strict JSON")
        return ToolCall(new_tool_call_id(), name, compact)


def _collect(stream: StreamingForcedToolCalls, text: str) -> list[ToolCall]:
    """The calls of a whole output, read as the stream reads them so the two agree."""
    stream.feed(text)
    stream.finish()
    return stream.calls


def parse_required_output(text: str, tools: Sequence[ToolSpec]) -> list[ToolCall]:
    """The calls of an output constrained by `required_tools_schema`."""
    return _collect(StreamingForcedToolCalls.for_required(tools), text)


def named_output(text: str, tool: ToolSpec) -> ToolCall:
    """The call of an output constrained by `named_tool_schema(tool)`."""
    (call,) = _collect(StreamingForcedToolCalls.for_named(tool), text)
    return call
