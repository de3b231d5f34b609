"""`/v1/responses`, OpenAI's Responses API, as a translation over chat completions: the
request becomes a chat body, the chat answer becomes a Response and the chat stream's
typed chunks become Responses events (`ResponsesEndpoint`, served by the chat flow).

The server is stateless: nothing is stored, so `previous_response_id` and `conversation`
are refused and a client sends the whole conversation in `input` every time. Fields follow
chat's three kinds: some are ignored on purpose (`user`, `store`, `service_tier`...), a
field of OpenAI's that is not served is refused unless sent at its default (a client that
asks for `background` or `include` relies on getting it), and a field never heard of is
ignored. Every refusal is a `RequestError` naming the field (`tools[1].type`).
"""

from __future__ import annotations

import re
from typing import Any

from services.tokenizer.choice_output import ChoiceOutput
from services.tokenizer.errors import RequestError
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.chat import ChatCompletionChunk, ChatCompletionRequest
from services.tokenizer.protocol.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
    TextFormat,
)
from services.tokenizer.responses_output import ResponsesStream, to_response
from services.tokenizer.serving_base import ChoiceAccumulator
from services.tokenizer.serving_chat import ChatEndpoint
from services.tokenizer.sse import Chunk, NamedEvent, TextDelta


def to_chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body that asks for the same answer, in OpenAI's chat shapes.
    A stream asks for the usage chunk, which `ResponsesStream.finish` reports."""
    body: dict[str, Any] = {"messages": _chat_messages(req)}
    if req.tools:
        body["tools"] = [_chat_tool(tool) for tool in req.tools]
    choice = req.tool_choice
    optional = {
        "model": req.model,
        "tool_choice": (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, FunctionChoice)
            else choice
        ),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "response_format": None if req.text is None else _response_format(req.text.format),
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """Consecutive function calls are one assistant message with `tool_calls`, joined to
    the assistant's text before them: the inverse of `to_response`, which splits one chat
    answer into a message item and call items. Reasoning items are dropped."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _response_format(fmt: TextFormat) -> dict[str, Any] | None:
    """Plain text needs no chat `response_format`."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {
        "name": fmt.name,
        "description": fmt.description,
        "schema": fmt.schema_,
        "strict": fmt.strict,
    }
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


_CHAT_PARAMS = (
    (re.compile(r"\bmessages(\[\d+\])?(\.[\w.]+)?"), "input"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\btools(\[\d+\])\.function\b"), r"tools\1"),
    (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
)
"""Chat's names for what the Responses request calls otherwise. A message index names no
input item (instructions and joined calls shift them), so it names `input` as a whole."""


def responses_error(err: RequestError) -> RequestError:
    """An error of the chat flow (`max_tokens` too large) in the Responses request's own
    names (`max_output_tokens`), so the client is told about a field it sent."""
    message, param = err.message, err.param
    for pattern, name in _CHAT_PARAMS:
        message = pattern.sub(name, message)
        param = None if param is None else pattern.sub(name, param)
    return RequestError(message, param=param, code=err.code, status=err.status)


class ResponsesEndpoint(ChatEndpoint):
    """The request translated into a chat completion (`to_chat_request`), served as one,
    and its answer or chunks translated back into a Response and its events. Stateless:
    nothing is stored. Its stream ends with its last event, not `[DONE]`."""

    id_prefix = "resp"
    prompt_param = "input"
    ends_with_done = False

    def __init__(self, request: ResponsesRequest, model: str):
        super().__init__(ChatCompletionRequest.model_validate(to_chat_request(request)), model)
        self.request = request
        self.responses = ResponsesStream(request, self.id, self.created, model)
        self.started = False

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        opening = [] if self.started else self.responses.start()
        self.started = True
        return [*opening, *self._translated(super().events(out, choice, acc))]

    def end(self) -> list[Chunk]:
        return [*self._translated(super().end()), *self.responses.finish()]

    def error(self, err: RequestError) -> list[Chunk]:
        return [*self.responses.error(responses_error(err))]

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        chat = super().answer(choices)
        return to_response(self.request, chat, self.id, self.header.created)

    def _translated(self, chunks: list[Chunk]) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        for chunk in chunks:
            assert isinstance(chunk, ChatCompletionChunk | TextDelta), "a chat stream's chunk"
            events += self.responses.feed(chunk)
        return events
