"""A chat choice's generated text to OpenAI's message parts: the reasoning section
(`reasoning_content`), the answer (`content`) and the tool calls (`tool_calls`).

One `ChoiceParser` per choice reads the text as it streams; a choice that is not streamed
is read by the same parser in one piece, so a stream always reassembles to the answer the
same request gets unstreamed.

Tool calls come from two places. Under `tool_choice: "auto"` the `--tool-call-parser`
finds them in the text the model chose to write. Under `"required"` or a named function
the grammar forced the output to be calls (`parsers.tool_choice`), read as such; a forced
call that max_tokens cut short is dropped, and `finish_reason: "length"` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer.parsers import (
    DEFAULT_TOOL_PARSER,
    ReasoningParser,
    StreamingForcedToolCalls,
    StreamingToolParser,
    ToolParser,
    ToolSpec,
    get_tool_parser,
    tool_specs,
)
from services.tokenizer.parsers import ToolCallDelta as ParsedDelta
from services.tokenizer.protocol.chat import (
    ChatCompletionRequest,
    NamedToolChoice,
    ToolCall,
    ToolCallDelta,
    ToolCallDeltaFunction,
    ToolCallFunction,
)
from services.tokenizer.protocol.common import FinishReasonName


@dataclass
class ChatDelta:
    """What one piece of a choice's text adds to its message."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: ChatDelta) -> ChatDelta:
        joined = ChatDelta(self.reasoning + later.reasoning, self.content + later.content)
        for call in [*self.tool_calls, *later.tool_calls]:
            joined.add_tool_call(call)
        return joined

    def add_tool_call(self, call: ToolCallDelta) -> None:
        """Appends `call`, merged into the previous piece of the same call: clients (the
        openai SDK's stream helper) merge a call's pieces across chunks, not within one."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is None or last.index != call.index:
            self.tool_calls.append(call)
            return
        arguments = (last.function.arguments or "") + (call.function.arguments or "")
        self.tool_calls[-1] = last.model_copy(
            update={"function": last.function.model_copy(update={"arguments": arguments})}
        )


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers of chat output (`--tool-call-parser`, `--reasoning-parser`)."""

    tool_call_parser: str = DEFAULT_TOOL_PARSER
    reasoning_parser: str | None = None


@dataclass(frozen=True)
class ChatOutputFormat:
    """How a request's choices are read: the same for each of its choices."""

    reasoning_parser: str | None
    starts_in_reasoning: bool
    enable_thinking: bool
    tools: tuple[ToolSpec, ...]
    tool_parser: ToolParser | None
    """Set under tool_choice "auto"."""
    forced: ToolSpec | None | bool
    """The named function, True under "required", False otherwise."""

    @classmethod
    def for_request(
        cls,
        request: ChatCompletionRequest,
        parsers: ChatParsers,
        *,
        starts_in_reasoning: bool,
        reasoning_closed: bool,
    ) -> ChatOutputFormat:
        choice = request.effective_tool_choice
        tools = tuple(tool_specs([t.model_dump() for t in request.tools])) if request.tools else ()
        forced: ToolSpec | None | bool = False
        if isinstance(choice, NamedToolChoice):
            forced = next(t for t in tools if t.name == choice.function.name)
        elif choice == "required":
            forced = True
        return cls(
            reasoning_parser=parsers.reasoning_parser,
            starts_in_reasoning=starts_in_reasoning,
            enable_thinking=not reasoning_closed,
            tools=tools if choice != "none" else (),
            tool_parser=(
                get_tool_parser(parsers.tool_call_parser) if choice == "auto" and tools else None
            ),
            forced=forced,
        )

    @property
    def plain(self) -> bool:
        """Text only: no reasoning section to split and no tools."""
        return self.reasoning_parser is None and not self.tools


class ChoiceParser:
    """One choice's text, fed as it arrives; `finish` once the choice has ended."""

    def __init__(self, fmt: ChatOutputFormat):
        self.fmt = fmt
        self.reasoning = (
            None
            if fmt.reasoning_parser is None
            else ReasoningParser(
                fmt.reasoning_parser,
                fmt.starts_in_reasoning or None,
                enable_thinking=fmt.enable_thinking,
            )
        )
        self.tools: StreamingToolParser | StreamingForcedToolCalls | None = None
        if isinstance(fmt.forced, ToolSpec):
            self.tools = StreamingForcedToolCalls.for_named(fmt.forced)
        elif fmt.forced:
            self.tools = StreamingForcedToolCalls.for_required(fmt.tools)
        elif fmt.tool_parser is not None:
            self.tools = StreamingToolParser(fmt.tool_parser, fmt.tools)
        self.num_tool_calls = 0

    def finish_reason(self, reason: FinishReasonName) -> FinishReasonName:
        """OpenAI's: "tool_calls" once the model chose to call (a named function forced
        on it ends with "stop")."""
        if reason == "stop" and self.num_tool_calls and not isinstance(self.fmt.forced, ToolSpec):
            return "tool_calls"
        return reason

    def feed(self, text: str) -> ChatDelta:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._answer(reasoning, content, final=False)

    def finish(self) -> ChatDelta:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._answer(reasoning, content, final=True)

    def _answer(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        delta = ChatDelta(reasoning=reasoning)
        if self.tools is None:
            delta.content = content
            return delta
        try:
            items = self.tools.feed(content) if content else []
            if final:
                items += self.tools.finish()
        except ValueError:
            items = []  # a forced call cut short: dropped, finish_reason "length" says so
        for item in items:
            if isinstance(item, str):
                delta.content += item
            else:
                delta.add_tool_call(_openai_delta(item))
                self.num_tool_calls = max(self.num_tool_calls, item.index + 1)
        return delta


def _openai_delta(item: ParsedDelta) -> ToolCallDelta:
    return ToolCallDelta(
        index=item.index,
        id=item.id,
        type="function" if item.id is not None else None,
        function=ToolCallDeltaFunction(name=item.name, arguments=item.arguments),
    )


@dataclass
class ChatMessageParts:
    """A whole choice's message, joined from its deltas."""

    reasoning: str = ""
    content: str = ""
    calls: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, delta: ChatDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        for d in delta.tool_calls:
            call = self.calls.get(d.index)
            if call is None:
                assert d.id is not None and d.function.name is not None, "a call opens first"
                self.calls[d.index] = ToolCall(
                    id=d.id,
                    function=ToolCallFunction(
                        name=d.function.name, arguments=d.function.arguments or ""
                    ),
                )
            else:
                call.function.arguments += d.function.arguments or ""

    @property
    def tool_calls(self) -> list[ToolCall] | None:
        return [self.calls[i] for i in sorted(self.calls)] or None


def parse_whole(
    fmt: ChatOutputFormat, text: str, reason: FinishReasonName
) -> tuple[ChatMessageParts, FinishReasonName]:
    """The message of a choice not streamed, and its finish reason: its text through the
    stream's parser."""
    parser, parts = ChoiceParser(fmt), ChatMessageParts()
    parts.add(parser.feed(text) + parser.finish())
    return parts, parser.finish_reason(reason)
