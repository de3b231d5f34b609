"""`/v1/chat/completions`: the messages (and tools) through the model's chat template, and
the output split into reasoning, content and tool calls (`chat_output`), as one
chat.completion or as its chunks."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

from engine.sampling.sampling_params import SamplingParams
from services.io_struct import WorkerReady
from services.tokenizer.chat_output import ChatOutputFormat, ChatParsers, ChoiceParser, parse_whole
from services.tokenizer.chat_template import render_chat
from services.tokenizer.choice_output import ChoiceOutput, TokenLogprob, shown_logprob
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
)
from services.tokenizer.request_mapper import check_chat_request
from services.tokenizer.serving_base import AppState, ChoiceAccumulator
from services.tokenizer.serving_openai import (
    ChunkPart,
    ChunkStream,
    OpenAIEndpoint,
    ResponseHeader,
    openai_finish_reason,
    usage_info,
)
from services.tokenizer.sse import Chunk


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


class ChatCompletionStream(ChunkStream[ChatCompletionResponseStreamChoice]):
    """Each choice opens with a `{"role": "assistant", "content": ""}` delta."""

    chunk_model = ChatCompletionChunk

    def _open(self, index: int) -> list[Chunk]:
        role = DeltaMessage(role="assistant", content="")
        return [self._chunk(ChatCompletionResponseStreamChoice(index=index, delta=role))]

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


def chat_prompt_chars(messages: Sequence[ChatCompletionMessageParam]) -> int:
    """The characters of a conversation's text: its contents and earlier calls' arguments."""
    return sum(
        len(m.content or "") + sum(len(c.function.arguments) for c in m.tool_calls or ())
        for m in messages
    )


class ChatEndpoint(OpenAIEndpoint):
    """One prompt: the conversation as the chat template renders it."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"
    body: ChatCompletionRequest
    stream_type = ChatCompletionStream

    def __init__(self, body: ChatCompletionRequest, model: str, parsers: ChatParsers):
        super().__init__(body, 1, model)
        self.parsers = parsers
        self.format: ChatOutputFormat | None = None
        """Set once the prompt is rendered: whether it left the model inside a reasoning
        section decides how the output is read."""
        self.choice_parsers: dict[int, ChoiceParser] = {}

    def check(self, lora_adapters: Collection[str]) -> None:
        super().check(lora_adapters)
        check_chat_request(self.body)

    def prompt_chars(self) -> int:
        return chat_prompt_chars(self.body.messages)

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        tokenizer = state.require_tokenizer(self.prompt_param)
        body = self.body
        prompt = render_chat(
            tokenizer,
            body.messages,
            tools=body.tools if body.effective_tool_choice != "none" else None,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            special_tokens_in_content=state.settings.allow_special_tokens_in_content,
        )
        self.format = ChatOutputFormat.for_request(
            body,
            self.parsers,
            starts_in_reasoning=prompt.opens_reasoning,
            reasoning_closed=prompt.reasoning_closed,
        )
        return [prompt.ids]

    def sampling_params(
        self, state: AppState, prompt_len: int, info: WorkerReady
    ) -> SamplingParams:
        """A grammar waits for the end of a reasoning section the model is still to write."""
        params = super().sampling_params(state, prompt_len, info)
        fmt = self.format
        if fmt is not None and fmt.reasoning_parser is not None and fmt.enable_thinking:
            params = dataclasses.replace(params, reasoning=True)
        return params

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        fmt = self.format
        if fmt is None or fmt.plain:
            return super().events(out, choice, acc)
        parser = self.choice_parsers.setdefault(out.index, ChoiceParser(fmt))
        delta = parser.feed(out.text)
        if choice is None:
            return self.stream.delta(out.index, delta.content, out.logprobs, delta)
        delta += parser.finish()
        return self.stream.finish(
            out.index, choice, delta.content, out.logprobs, delta, parser.finish_reason
        )

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        return chat_completion_response(self.header, choices, self.format).model_dump()
