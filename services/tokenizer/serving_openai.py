"""What chat and completions share, OpenAI's shape around their choices: the endpoint base
that serves only the served model and fails a request on an aborted choice, the header
every response and chunk repeats, finish reasons, usage, and the chunk stream whose
choices the two shape differently (`serving_chat`, `serving_completions`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, TypeVar

from services.io_struct import FinishReason
from services.tokenizer.chat_output import ChatDelta
from services.tokenizer.choice_output import REQUESTED_ABORT_STATUS, ChoiceOutput, TokenLogprob
from services.tokenizer.errors import RequestError, error_body
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.chat import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
)
from services.tokenizer.protocol.common import (
    ChoicesEnvelope,
    FinishReasonName,
    PromptTokensDetails,
    UsageInfo,
)
from services.tokenizer.protocol.completions import CompletionRequest, CompletionResponseChoice
from services.tokenizer.serving_base import ChoiceAccumulator, Endpoint
from services.tokenizer.sse import Chunk, DeltaEvents, TextDelta


@dataclass(frozen=True)
class ResponseHeader:
    """What every response and chunk of one request repeats."""

    id: str
    model: str
    created: int

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "created": self.created}

    def with_usage(self, choices: Sequence[ChoiceOutput], n: int) -> dict[str, Any]:
        """The fields of a whole response around its choices: these and its usage."""
        return {**self.fields(), "usage": usage_info(choices, n)}


def openai_finish_reason(reason: FinishReason) -> FinishReasonName:
    """An abort has no OpenAI finish reason: the request failed, and the client gets an
    error instead of a truncated answer that looks complete. One asked for
    (`REQUESTED_ABORT_STATUS`) is "abort"."""
    if reason.type == "abort" and reason.status_code == REQUESTED_ABORT_STATUS:
        return "abort"
    if reason.type == "abort":
        raise RequestError(
            reason.message or "the request was aborted", code="request_aborted", status=500
        )
    return "length" if reason.type == "length" else "stop"


def raise_if_aborted(out: ReqOutput, stream: bool) -> None:
    """An aborted OpenAI choice fails the whole request, with the worker's status (400
    when it refused the request, 500 otherwise). One asked for (`/abort_request`) is no
    failure in a stream: it ends with finish reason "abort"."""
    reason = out.finished_reason
    if stream and reason is not None and reason.status_code == REQUESTED_ABORT_STATUS:
        return
    if reason is not None and reason.type == "abort":
        raise RequestError(
            reason.message or "the request was aborted",
            code="request_aborted",
            status=reason.status_code or 500,
        )


def usage_info(choices: Sequence[ChoiceOutput], n: int) -> UsageInfo:
    """Usage of a whole request. Each prompt is counted once, not once per sample: it is
    computed once and its copies hit it in the radix cache; its cached tokens are its
    smallest hit among those copies, the one the first prefill had."""
    groups = [choices[i : i + n] for i in range(0, len(choices), n)]
    prompt = sum(group[0].prompt_tokens for group in groups)
    completion = sum(c.completion_tokens for c in choices)
    cached = sum(min(c.cached_tokens for c in group) for group in groups)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


@dataclass(frozen=True)
class ChunkPart:
    """What one chunk of a stream says of one choice."""

    index: int
    text: str
    logprobs: Sequence[TokenLogprob]
    reason: FinishReasonName | None
    text_offset: int
    """Where `text` starts in the choice's text."""
    message: ChatDelta | None = None
    """Chat's reasoning, content and tool-call pieces, when the text was parsed into them."""


StreamChoiceT = TypeVar(
    "StreamChoiceT", ChatCompletionResponseStreamChoice, CompletionResponseChoice
)


class ChunkStream(ABC, Generic[StreamChoiceT]):
    """The chunks of one streamed request, in OpenAI's order: per choice its deltas and a
    chunk with its finish reason; then, with `include_usage`, a chunk with empty choices
    and the usage of the whole request (`[DONE]` is the edge's). Chat and completions
    differ only in how a choice's chunk looks and whether a choice opens with a role."""

    chunk_model: type[ChoicesEnvelope[StreamChoiceT]]

    def __init__(self, header: ResponseHeader, n: int = 1, include_usage: bool = False):
        self.header = header
        self.n = n
        self.include_usage = include_usage
        self.outputs: dict[int, ChoiceOutput] = {}
        self.text_offsets: dict[int, int] = {}
        """Per choice opened, the length of the text streamed so far."""

    def delta(
        self,
        index: int,
        text: str,
        logprobs: Sequence[TokenLogprob] = (),
        message: ChatDelta | None = None,
    ) -> list[Chunk]:
        """Chunks for new text of choice `index` (none for an empty delta); plain text of
        a choice already opened is a `TextDelta` (the per-token hot path)."""
        offset = self.text_offsets.get(index)
        chunks: list[Chunk] = []
        if offset is None:
            chunks = self._open(index)
            offset = self.text_offsets[index] = 0
        elif not logprobs and message is None:
            if not text:
                return chunks
            self.text_offsets[index] = offset + len(text)
            return [TextDelta(index, text)]
        if (message if message is not None else text) or logprobs:
            part = ChunkPart(index, text, logprobs, None, offset, message)
            chunks.append(self._chunk(self._choice(part)))
            self.text_offsets[index] = offset + len(text)
        return chunks

    def text_chunk(self, delta: TextDelta) -> ChoicesEnvelope[StreamChoiceT]:
        """The full chunk `delta` stands for."""
        return self._chunk(self._choice(ChunkPart(delta.index, delta.text, (), None, 0)))

    def finish(
        self,
        index: int,
        output: ChoiceOutput,
        text: str = "",
        logprobs: Sequence[TokenLogprob] = (),
        message: ChatDelta | None = None,
        reason_of: Callable[[FinishReasonName], FinishReasonName] | None = None,
    ) -> list[Chunk]:
        """Chunks for the last text of choice `index` and its end; `reason_of` may turn
        the engine's finish reason into another (chat's "tool_calls"). Raises
        `RequestError` for an aborted choice: pass it to `error`."""
        reason = openai_finish_reason(output.finish_reason)
        if reason_of is not None:
            reason = reason_of(reason)
        chunks = self.delta(index, text, logprobs, message)
        self.outputs[index] = output
        last = ChunkPart(index, "", (), reason, self.text_offsets[index])
        chunks.append(self._chunk(self._choice(last)))
        return chunks

    def end(self) -> list[Chunk]:
        """The closing chunks, once every choice has finished."""
        if not self.include_usage:
            return []
        usage = usage_info([self.outputs[i] for i in sorted(self.outputs)], self.n)
        return [self.chunk_model(**self.header.fields(), choices=[], usage=usage)]

    def error(self, err: RequestError) -> list[Chunk]:
        """A stream cannot change its HTTP status once started: the error is a chunk."""
        return [error_body(err)]

    def _chunk(self, choice: StreamChoiceT) -> ChoicesEnvelope[StreamChoiceT]:
        return self.chunk_model(**self.header.fields(), choices=[choice])

    def _open(self, index: int) -> list[Chunk]:
        """Chunks that open choice `index`, before its first delta."""
        return []

    @abstractmethod
    def _choice(self, part: ChunkPart) -> StreamChoiceT:
        """`part` as the choice's entry in a chunk."""


class OpenAIEndpoint(Endpoint):
    """Chat and completions: only the served model is answered (or one of its LoRA
    adapters), an aborted choice fails the whole request, and the answer is OpenAI's
    response object or chunk stream (`stream_type`)."""

    n_param = "n"
    body: ChatCompletionRequest | CompletionRequest
    stream_type: type[ChunkStream[Any]]

    @property
    def n(self) -> int:
        return self.body.n

    @property
    def cache_salt(self) -> str | None:
        return self.body.cache_salt

    @property
    def priority(self) -> int:
        return self.body.priority

    @cached_property
    def header(self) -> ResponseHeader:
        """`prepare` refuses any model but the served one and its LoRA adapters: the name
        sent is served."""
        return ResponseHeader(id=self.id, model=self.body.model or self.model, created=self.created)

    @cached_property
    def stream(self) -> ChunkStream[Any]:
        return self.stream_type(self.header, n=self.body.n, include_usage=self.body.include_usage)

    @cached_property
    def deltas(self) -> DeltaEvents:
        return DeltaEvents(self.stream.text_chunk)

    def check_output(self, out: ReqOutput) -> None:
        raise_if_aborted(out, self.body.stream)

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        if choice is None:
            return self.stream.delta(out.index, out.text, out.logprobs)
        return self.stream.finish(out.index, choice, out.text, out.logprobs)

    def end(self) -> list[Chunk]:
        return self.stream.end()

    def error(self, err: RequestError) -> list[Chunk]:
        return self.stream.error(err)
