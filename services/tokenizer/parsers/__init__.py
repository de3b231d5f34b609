"""Pure text processing for the OpenAI API: tool calls, forced tool choice, tools in the
prompt, and reasoning sections. Synchronous, without I/O or models, so each piece is tested
on its own."""

from services.tokenizer.parsers.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningFormat,
    ReasoningParser,
)
from services.tokenizer.parsers.tool_choice import (
    StreamingForcedToolCalls,
    named_output,
    named_tool_schema,
    parse_required_output,
    required_tools_schema,
)
from services.tokenizer.parsers.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedToolCalls,
    PythonicToolParser,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolSpec,
    ToolStreamItem,
    get_tool_parser,
    new_tool_call_id,
    tool_specs,
)
from services.tokenizer.parsers.tool_render import (
    messages_with_tools,
    render_tools_system_prompt,
    template_supports_tools,
)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedToolCalls",
    "PythonicToolParser",
    "ReasoningFormat",
    "ReasoningParser",
    "StreamingForcedToolCalls",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolSpec",
    "ToolStreamItem",
    "get_tool_parser",
    "messages_with_tools",
    "named_output",
    "named_tool_schema",
    "new_tool_call_id",
    "parse_required_output",
    "render_tools_system_prompt",
    "required_tools_schema",
    "template_supports_tools",
    "tool_specs",
]
