"""Results out: finished engine choices to OpenAI responses, stream deltas to SSE events,
and SGLang's native `/generate` answer.

Choices are numbered as OpenAI numbers them: with `p` prompts and `n` samples each, choice
`i * n + j` is sample `j` of prompt `i` (chat has one prompt).
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel

from services.io_struct import FinishReason
from services.tokenizer.adapters import RequestError, error_body
from services.tokenizer.chat_output import ChatDelta, ChatOutputFormat, parse_whole
from services.tokenizer.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    ChoicesEnvelope,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    FinishReasonName,
    LoRAModelCard,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    VllmLogprob,
)

if TYPE_CHECKING:
    from engine.outputs import GenerateResult

SSE_DONE = "data: [DONE]\n\n"
"""The last event of every OpenAI stream."""

LOGPROB_FLOOR = -9999.0
"""The least logprob a response shows (vLLM's floor): a token the grammar or a bias forbade
has -inf, which the sampler sends as float32's minimum, and neither is a number a JSON
client expects."""


def shown_logprob(value: float) -> float:
    """`value`, floored at `LOGPROB_FLOOR`; a NaN (which compares false) is floored too."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _shown_or_none(value: float | None) -> float | None:
    """An echoed prompt's first token has no logprob: it stays null."""
    return None if value is None else shown_logprob(value)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and its most likely alternatives, with their text. A prompt's
    first token has none (None): nothing comes before it to predict it."""

    token_id: int
    token: str
    logprob: float | None
    top_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ChoiceOutput:
    """One finished choice, as the tokenizer service holds it once detokenized."""

    text: str
    output_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    """Present only when the request asked for logprobs."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """Per prompt position from `logprob_start_len`; present only when asked."""

    @classmethod
    def from_engine_result(cls, result: GenerateResult) -> ChoiceOutput:
        """From a finished result of the offline Engine."""
        meta, reason = result.meta, result.meta.finish_reason
        if reason is None:
            raise ValueError("an unfinished engine result has no choice")
        return cls(
            text=result.text,
            output_ids=list(result.output_ids),
            finish_reason=FinishReason(
                reason.type, reason.matched, reason.message, reason.status_code
            ),
            prompt_tokens=meta.prompt_tokens,
            completion_tokens=meta.completion_tokens,
            cached_tokens=meta.cached_tokens,
        )


@dataclass(frozen=True)
class ResponseHeader:
    """What every response and chunk of one request repeats."""

    id: str
    model: str
    created: int

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "created": self.created}


REQUESTED_ABORT_STATUS = 499
"""The status of a request aborted because it was asked to (`/abort_request`): nginx's
"client closed request", never a server error. Such a stream ends with finish reason
"abort" (vLLM's name); an answer not streamed is this status with an error body."""


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


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> ChoiceLogprobs:
    def entry(lp: TokenLogprob) -> TopLogprob:
        assert lp.logprob is not None, "chat reports generated tokens only, each predicted"
        return TopLogprob(
            token=lp.token, logprob=shown_logprob(lp.logprob), bytes=list(lp.token.encode())
        )

    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                **entry(lp).model_dump(), top_logprobs=[entry(t) for t in lp.top_logprobs]
            )
            for lp in logprobs
        ]
    )


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    """The legacy completions shape; `text_offset` is where these tokens start in the
    choice's text (non-zero for the later chunks of a stream). An echoed prompt's first
    token has null logprob and null alternatives, as OpenAI's echo gives it."""
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return CompletionLogprobs(
        text_offset=offsets,
        token_logprobs=[_shown_or_none(lp.logprob) for lp in logprobs],
        tokens=[lp.token for lp in logprobs],
        top_logprobs=[
            None
            if lp.logprob is None
            else {
                t.token: shown_logprob(t.logprob) for t in lp.top_logprobs if t.logprob is not None
            }
            for lp in logprobs
        ],
    )


def chat_completion_response(
    header: ResponseHeader,
    choices: Sequence[ChoiceOutput],
    fmt: ChatOutputFormat | None = None,
) -> ChatCompletionResponse:
    """`fmt` says how to split each choice's text into reasoning, content and tool calls
    (None: it is all content)."""
    return ChatCompletionResponse(
        **header.fields(),
        choices=[_chat_choice(i, c, fmt) for i, c in enumerate(choices)],
        usage=usage_info(choices, n=len(choices)),
    )


def _chat_choice(
    index: int, choice: ChoiceOutput, fmt: ChatOutputFormat | None
) -> ChatCompletionResponseChoice:
    reason = openai_finish_reason(choice.finish_reason)
    message = ChatMessage(content=choice.text)
    if fmt is not None and not fmt.plain:
        parts, reason = parse_whole(fmt, choice.text, reason)
        message = ChatMessage(
            content=parts.content or None if parts.calls else parts.content,
            reasoning_content=parts.reasoning or None,
            tool_calls=parts.tool_calls,
        )
    return ChatCompletionResponseChoice(
        index=index,
        message=message,
        logprobs=None if choice.logprobs is None else chat_logprobs(choice.logprobs),
        finish_reason=reason,
    )


def completion_response(
    header: ResponseHeader, choices: Sequence[ChoiceOutput], n: int, vllm_prompt: bool = False
) -> CompletionResponse:
    """`vllm_prompt`: the request asked for vLLM's `prompt_logprobs`."""
    return CompletionResponse(
        **header.fields(),
        choices=[
            CompletionResponseChoice(
                index=i,
                text=c.text,
                logprobs=None if c.logprobs is None else completion_logprobs(c.logprobs),
                finish_reason=openai_finish_reason(c.finish_reason),
                prompt_logprobs=vllm_prompt_logprobs(c.prompt_logprobs or ())
                if vllm_prompt
                else None,
            )
            for i, c in enumerate(choices)
        ],
        usage=usage_info(choices, n),
    )


def sse_event(obj: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: `data: <json>` and a blank line. NaN and infinities are
    refused (ValueError), as in a JSON response: they are not JSON."""
    payload = (
        obj.model_dump_json()
        if isinstance(obj, BaseModel)
        else json.dumps(obj, ensure_ascii=False, allow_nan=False)
    )
    return f"data: {payload}\n\n"


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


class _Stream(ABC, Generic[StreamChoiceT]):
    """SSE events of one streamed request, in OpenAI's order: per choice its deltas and a
    chunk with its finish reason; then, with `include_usage`, a chunk with empty choices
    and the usage of the whole request; then `[DONE]`. Chat and completions differ only
    in how a choice's chunk looks and whether a choice opens with a role."""

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
    ) -> list[str]:
        """Events for new text of choice `index` (none for an empty delta)."""
        events: list[str] = [] if index in self.text_offsets else self._open(index)
        offset = self.text_offsets.setdefault(index, 0)
        if (message if message is not None else text) or logprobs:
            part = ChunkPart(index, text, logprobs, None, offset, message)
            events.append(self._event(self._choice(part)))
            self.text_offsets[index] = offset + len(text)
        return events

    def finish(
        self,
        index: int,
        output: ChoiceOutput,
        text: str = "",
        logprobs: Sequence[TokenLogprob] = (),
        message: ChatDelta | None = None,
        reason_of: Callable[[FinishReasonName], FinishReasonName] | None = None,
    ) -> list[str]:
        """Events for the last text of choice `index` and its end; `reason_of` may turn
        the engine's finish reason into another (chat's "tool_calls"). Raises
        `RequestError` for an aborted choice: pass it to `error`."""
        reason = openai_finish_reason(output.finish_reason)
        if reason_of is not None:
            reason = reason_of(reason)
        events = self.delta(index, text, logprobs, message)
        self.outputs[index] = output
        last = ChunkPart(index, "", (), reason, self.text_offsets[index])
        events.append(self._event(self._choice(last)))
        return events

    def end(self) -> list[str]:
        """The closing events, once every choice has finished."""
        events: list[str] = []
        if self.include_usage:
            usage = usage_info([self.outputs[i] for i in sorted(self.outputs)], self.n)
            events.append(
                sse_event(self.chunk_model(**self.header.fields(), choices=[], usage=usage))
            )
        return [*events, SSE_DONE]

    def error(self, err: RequestError) -> list[str]:
        """A stream cannot change its HTTP status once started: the error is an event."""
        return [sse_event(error_body(err)), SSE_DONE]

    def _event(self, choice: StreamChoiceT) -> str:
        return sse_event(self.chunk_model(**self.header.fields(), choices=[choice]))

    def _open(self, index: int) -> list[str]:
        """Events that open choice `index`, before its first delta."""
        return []

    @abstractmethod
    def _choice(self, part: ChunkPart) -> StreamChoiceT:
        """`part` as the choice's entry in a chunk."""


class ChatCompletionStream(_Stream[ChatCompletionResponseStreamChoice]):
    """Each choice opens with a `{"role": "assistant", "content": ""}` delta."""

    chunk_model = ChatCompletionChunk

    def _open(self, index: int) -> list[str]:
        role = DeltaMessage(role="assistant", content="")
        return [self._event(ChatCompletionResponseStreamChoice(index=index, delta=role))]

    def _choice(self, part: ChunkPart) -> ChatCompletionResponseStreamChoice:
        message = part.message
        delta = (
            DeltaMessage(content=part.text or None)
            if message is None
            else DeltaMessage(
                content=message.content or None,
                reasoning_content=message.reasoning or None,
                tool_calls=message.tool_calls or None,
            )
        )
        return ChatCompletionResponseStreamChoice(
            index=part.index,
            delta=delta,
            logprobs=chat_logprobs(part.logprobs) if part.logprobs else None,
            finish_reason=part.reason,
        )


def echoed(prompt: str, choice: ChoiceOutput) -> ChoiceOutput:
    """`choice` with its prompt in front of its text, and in front of its logprobs when it
    has them: OpenAI's `echo`."""
    logprobs = choice.logprobs
    if logprobs is not None:
        logprobs = (*(choice.prompt_logprobs or ()), *logprobs)
    return dataclasses.replace(choice, text=prompt + choice.text, logprobs=logprobs)


def vllm_prompt_logprobs(
    entries: Sequence[TokenLogprob],
) -> list[dict[str, VllmLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, a map from token id to its logprob, the
    prompt's own token first, then its likeliest alternatives; null for the first token."""
    result: list[dict[str, VllmLogprob] | None] = []
    for lp in entries:
        if lp.logprob is None:
            result.append(None)
            continue
        by_id = {
            str(lp.token_id): VllmLogprob(logprob=shown_logprob(lp.logprob), decoded_token=lp.token)
        }
        for t in lp.top_logprobs:
            if t.logprob is not None:  # alternatives always have one; the type allows None
                by_id.setdefault(
                    str(t.token_id),
                    VllmLogprob(logprob=shown_logprob(t.logprob), decoded_token=t.token),
                )
        result.append(by_id)
    return result


class CompletionStream(_Stream[CompletionResponseChoice]):
    """Logprob text offsets continue across a choice's chunks."""

    chunk_model = CompletionChunk

    def _choice(self, part: ChunkPart) -> CompletionResponseChoice:
        logprobs = part.logprobs
        return CompletionResponseChoice(
            index=part.index,
            text=part.text,
            logprobs=completion_logprobs(logprobs, part.text_offset) if logprobs else None,
            finish_reason=part.reason,
        )


def generate_response(output: ChoiceOutput) -> dict[str, Any]:
    """SGLang's native answer for one prompt (one sample): its progress at the end, with
    the finish reason and, when asked, the logprobs. An abort is reported in
    `finish_reason`, as SGLang does, not turned into an error: native clients read it."""
    reason = output.finish_reason
    finish_reason = {"type": reason.type, "matched": reason.matched, "message": reason.message}
    answer = generate_progress(
        output.text,
        output.output_ids,
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        cached_tokens=output.cached_tokens,
    )
    meta_info = answer["meta_info"]
    meta_info["finish_reason"] = {k: v for k, v in finish_reason.items() if v is not None}
    if output.logprobs is not None:
        meta_info["output_token_logprobs"] = [_native_logprob(lp) for lp in output.logprobs]
        meta_info["output_top_logprobs"] = [
            [_native_logprob(t) for t in lp.top_logprobs] for lp in output.logprobs
        ]
    if output.prompt_logprobs is not None:
        meta_info["input_token_logprobs"] = [_native_logprob(lp) for lp in output.prompt_logprobs]
        meta_info["input_top_logprobs"] = [
            [_native_logprob(t) for t in lp.top_logprobs] or None for lp in output.prompt_logprobs
        ]
    return answer


def _native_logprob(lp: TokenLogprob) -> list[Any]:
    """SGLang's `[logprob, token id, text]`; the prompt's first token has a null logprob."""
    return [_shown_or_none(lp.logprob), lp.token_id, lp.token]


def generate_progress(
    text: str,
    output_ids: Sequence[int],
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """SGLang's native answer so far for a prompt still generating (a stream's event):
    the text and ids until now, and a null `finish_reason`."""
    meta_info: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "finish_reason": None,
    }
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info}


def model_list(
    model: str, max_model_len: int | None, created: int, adapters: Iterable[str] = ()
) -> ModelList:
    """The base model, then each LoRA adapter with the base model as its parent."""
    base = ModelCard(id=model, created=created, max_model_len=max_model_len)
    cards = [
        LoRAModelCard(id=name, created=created, max_model_len=max_model_len, parent=model)
        for name in adapters
    ]
    return ModelList(data=[base, *cards])
