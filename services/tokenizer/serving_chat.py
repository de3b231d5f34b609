"""`/v1/chat/completions`: the messages (and tools) through the model's chat template, and
the output split into reasoning, content and tool calls (`chat_output`), as one
chat.completion or as its chunks."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from services.tokenizer.chat_output import ChatOutputFormat, ChoiceParser, parse_whole
from services.tokenizer.chat_template import render_chat, turn_end_ids
from services.tokenizer.choice_output import ChoiceOutput, TokenLogprob, shown_logprob
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.chat import (
    ChatCompletionChunk,
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
from services.tokenizer.serving_base import AppState, ChoiceAccumulator
from services.tokenizer.serving_openai import ChunkStream, OpenAIEndpoint, openai_finish_reason
from services.tokenizer.sse import Chunk

if TYPE_CHECKING:
    from services.tokenizer.serving_openai import ChunkPart, ResponseHeader


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
        **header.with_usage(choices, n=len(choices)),
        choices=[_chat_choice(i, c, fmt) for i, c in enumerate(choices)],
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


class ChatEndpoint(OpenAIEndpoint):
    """One prompt: the conversation as the chat template renders it."""

    id_prefix = "chatcmpl"
    prompt_param = "messages"
    needs_tokenizer = True
    body: ChatCompletionRequest
    stream_type = ChatCompletionStream
    format: ChatOutputFormat | None = None
    """Set once the prompt is rendered: whether it left the model inside a reasoning section
    decides how the output is read."""

    @property
    def num_prompts(self) -> int:
        return 1

    @cached_property
    def choice_parsers(self) -> dict[int, ChoiceParser]:
        return {}

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        body, tokenizer = self.body, state.tokenizer
        assert tokenizer is not None, "needs_tokenizer: `prepare` refused the request without one"
        prompt = render_chat(
            tokenizer,
            body.messages,
            tools=body.tools if body.effective_tool_choice != "none" else None,
            template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            special_tokens_in_content=state.settings.allow_special_tokens_in_content,
        )
        fmt = self.format = ChatOutputFormat.for_request(
            body,
            state.chat_parsers,
            starts_in_reasoning=prompt.opens_reasoning,
            reasoning_closed=prompt.reasoning_closed,
        )
        self.grammar_after_reasoning = fmt.reasoning_parser is not None and fmt.enable_thinking
        self.turn_end_ids = turn_end_ids(tokenizer)
        return [prompt.ids]

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
