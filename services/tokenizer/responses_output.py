"""A chat answer as OpenAI's Response object (`to_response`) and a chat stream's chunks as
the Response's events (`ResponsesStream`): the way back of `serving_responses`' translation."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from services.tokenizer.errors import RequestError
from services.tokenizer.protocol.chat import ChatCompletionChunk, ToolCallDelta
from services.tokenizer.protocol.responses import FunctionChoice, ResponsesRequest, TextConfig
from services.tokenizer.sse import NamedEvent, TextDelta


def to_response(
    req: ResponsesRequest, chat_response: dict[str, Any], response_id: str, created_at: int
) -> dict[str, Any]:
    """The Response for a chat.completion answer of `to_chat_request(req)`, its items in
    OpenAI's order: the reasoning, the message, one function_call per tool call."""
    choice = chat_response["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    for kind in (REASONING, MESSAGE):
        if message.get(kind.chat_field):
            item = kind.item(_item_id(response_id, kind.prefix, len(output)), "completed")
            item["content"].append(kind.part(message[kind.chat_field]))
            output.append(item)
    for call in message.get("tool_calls") or []:
        function = call["function"]
        item_id = _item_id(response_id, "fc", len(output))
        output.append(
            _function_call_item(item_id, call["id"], function["name"], function["arguments"])
        )
    status = _status(choice["finish_reason"])
    if output:
        output[-1]["status"] = status  # the item being generated when it stopped
    return _response(
        req,
        response_id,
        created_at,
        chat_response["model"],
        status=status,
        output=output,
        usage=_usage(chat_response["usage"]),
    )


Status = Literal["in_progress", "completed", "incomplete"]


def _status(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


def _item_id(response_id: str, prefix: str, output_index: int) -> str:
    """Item ids follow from the response's and the item's place in the output, so the
    streamed answer and the whole one name their items alike."""
    return f"{prefix}_{response_id.removeprefix('resp_')}_{output_index}"


@dataclass(frozen=True)
class TextKind:
    """An output item of one text part: the message, or the reasoning (chat's
    `reasoning_content`), which OpenAI returns as raw `reasoning_text` content."""

    item_type: Literal["message", "reasoning"]
    chat_field: str
    prefix: str
    part_type: str
    """Also the stem of its stream events: `response.<part_type>.delta`."""

    def item(self, item_id: str, status: Status) -> dict[str, Any]:
        fields: dict[str, Any] = (
            {"role": "assistant"} if self.item_type == "message" else {"summary": []}
        )
        return {"id": item_id, "type": self.item_type, **fields, "status": status, "content": []}

    def part(self, text: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"annotations": []} if self.item_type == "message" else {}
        return {"type": self.part_type, "text": text, **extra}

    @property
    def event_extra(self) -> dict[str, Any]:
        """Output text events carry logprobs, never asked for here."""
        return {"logprobs": []} if self.item_type == "message" else {}


MESSAGE = TextKind("message", "content", "msg", "output_text")
REASONING = TextKind("reasoning", "reasoning_content", "rs", "reasoning_text")
_TEXT_KINDS = {kind.item_type: kind for kind in (MESSAGE, REASONING)}


def _function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: Status = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in Responses' names. No cache writes: the radix cache is implicit, and
    chat's usage reports none."""
    details = usage.get("prompt_tokens_details") or {}
    output_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": details.get("cached_tokens", 0),
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": output_details.get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


def _response(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    *,
    status: Status,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The Response object: the request's parameters as they were applied (omitted
    sampling parameters are the engine's defaults, which are OpenAI's)."""
    choice = req.tool_choice
    text = TextConfig() if req.text is None else req.text
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": usage,
        "instructions": req.instructions,
        "tools": [tool.model_dump() for tool in req.tools],
        "tool_choice": choice.model_dump()
        if isinstance(choice, FunctionChoice)
        else choice or "auto",
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_logprobs": 0,
        "text": text.model_dump(by_alias=True, exclude_none=True),
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "background": False,
        "store": False,
        "previous_response_id": None,
        "metadata": req.metadata or {},
        "user": req.user,
        "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key,
    }


# ---------------------------------------------------------------------------- streaming


class ResponsesStream:
    """The Responses events of one streamed request, from the typed chunks of
    `to_chat_request(req)`'s chat stream, as OpenAI orders them: the response created and in
    progress; each output item added, its deltas and done before the next is added; then
    the response completed (or incomplete) with the usage of the final chunk.

    Chat streams its reasoning, then its text, then each tool call whole before the next;
    text after a call is a new item.
    """

    def __init__(self, req: ResponsesRequest, response_id: str, created_at: int, model: str):
        """`model` is the served model: the request may omit it, and the events before the
        first chunk name it."""
        self.req = req
        self.response_id = response_id
        self.created_at = created_at
        self.model = model
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        """The items so far, as they stand; the last is open while "in_progress"."""
        self.open_call: int | None = None
        """The chat tool call index of the last function_call item."""
        self.calls_seen: set[int] = set()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def start(self) -> list[NamedEvent]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, chunk: ChatCompletionChunk | TextDelta) -> list[NamedEvent]:
        """Events for one chat chunk (none for the role-only first one and the usage one);
        a `TextDelta` is plain content."""
        if isinstance(chunk, TextDelta):
            return self._text(MESSAGE, chunk.text)
        if chunk.usage is not None:
            self.usage = _usage(chunk.usage.model_dump())
        events: list[NamedEvent] = []
        for choice in chunk.choices:
            for kind in (REASONING, MESSAGE):
                if text := getattr(choice.delta, kind.chat_field):
                    events += self._text(kind, text)
            for call in choice.delta.tool_calls or ():
                events += self._call(call)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        return events

    def finish(self) -> list[NamedEvent]:
        """The closing events, once the chat stream has ended (its usage chunk fed)."""
        status = _status(self.finish_reason)
        events = self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._response(status))]

    def error(self, err: RequestError) -> list[NamedEvent]:
        """A stream cannot change its HTTP status once started: the error is an event."""
        return [self._event("error", code=err.code, message=err.message, param=err.param)]

    def _open_item(self) -> dict[str, Any] | None:
        item = self.output[-1] if self.output else None
        return item if item is not None and item["status"] == "in_progress" else None

    def _text(self, kind: TextKind, text: str) -> list[NamedEvent]:
        events: list[NamedEvent] = []
        item = self._open_item()
        if item is None or item["type"] != kind.item_type:
            events += self._close("completed")
            item = kind.item(self._next_id(kind.prefix), "in_progress")
            events.append(self._add(item))
            part = kind.part("")
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._at(), part=dict(part)))
        item["content"][0]["text"] += text
        events.append(
            self._event(
                f"response.{kind.part_type}.delta", **self._at(), delta=text, **kind.event_extra
            )
        )
        return events

    def _call(self, call: ToolCallDelta) -> list[NamedEvent]:
        index, function = call.index, call.function
        events: list[NamedEvent] = []
        item = self._open_item()
        if item is None or item["type"] != "function_call" or self.open_call != index:
            if index in self.calls_seen:
                raise ValueError(f"the chat stream went back to tool call {index}")
            if call.id is None or function.name is None:
                raise ValueError(f"the chat stream's tool call {index} opens with no id or name")
            events += self._close("completed")
            item_id = self._next_id("fc")
            item = _function_call_item(item_id, call.id, function.name, "", "in_progress")
            events.append(self._add(item))
            self.open_call = index
            self.calls_seen.add(index)
        if function.arguments:
            item["arguments"] += function.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    **self._at(content=False),
                    delta=function.arguments,
                )
            )
        return events

    def _add(self, item: dict[str, Any]) -> NamedEvent:
        """The event shows `item` as it is now: the stream goes on filling it."""
        self.output.append(item)
        return self._event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=copy.deepcopy(item),
        )

    def _close(self, status: Status) -> list[NamedEvent]:
        """The done events of the open item, if any, which ends with `status`."""
        item = self._open_item()
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "function_call":
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **self._at(content=False),
                    name=item["name"],
                    arguments=item["arguments"],
                )
            ]
        else:
            kind, part = _TEXT_KINDS[item["type"]], item["content"][0]
            events = [
                self._event(
                    f"response.{kind.part_type}.done",
                    **self._at(),
                    text=part["text"],
                    **kind.event_extra,
                ),
                self._event("response.content_part.done", **self._at(), part=part),
            ]
        events.append(
            self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)
        )
        return events

    def _next_id(self, prefix: str) -> str:
        return _item_id(self.response_id, prefix, len(self.output))

    def _at(self, content: bool = True) -> dict[str, Any]:
        """Where an event of the last item points: its id, its place, its one part."""
        at: dict[str, Any] = {
            "item_id": self.output[-1]["id"],
            "output_index": len(self.output) - 1,
        }
        if content:
            at["content_index"] = 0
        return at

    def _response(self, status: Status) -> dict[str, Any]:
        output = [] if status == "in_progress" else self.output
        usage = None if status == "in_progress" else self.usage
        return _response(
            self.req,
            self.response_id,
            self.created_at,
            self.model,
            status=status,
            output=output,
            usage=usage,
        )

    def _event(self, kind: str, **fields: Any) -> NamedEvent:
        """One event, named as OpenAI names it; nothing it holds changes afterwards (an
        item or part still being filled is given as a copy)."""
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return NamedEvent(kind, payload)


# ---------------------------------------------------------------------------- the endpoint
