"""`/v1/completions`: a batch of prompts, texts or token ids, answered as one
text_completion or as its chunks; with `echo` each choice's text (and logprobs) starts with
its prompt's, and vLLM's `prompt_logprobs` are served beside them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from services.tokenizer.choice_output import (
    ChoiceOutput,
    TokenLogprob,
    shown_logprob,
    shown_or_none,
)
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.completions import (
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    VllmLogprob,
)
from services.tokenizer.request_mapper import tokenize_prompts
from services.tokenizer.serving_base import AppState, ChoiceAccumulator
from services.tokenizer.serving_openai import ChunkStream, OpenAIEndpoint, openai_finish_reason
from services.tokenizer.sse import Chunk

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from services.tokenizer.serving_openai import ChunkPart, ResponseHeader


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
        token_logprobs=[shown_or_none(lp.logprob) for lp in logprobs],
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


def completion_response(
    header: ResponseHeader, choices: Sequence[ChoiceOutput], n: int, vllm_prompt: bool = False
) -> CompletionResponse:
    """`vllm_prompt`: the request asked for vLLM's `prompt_logprobs`."""
    return CompletionResponse(
        **header.with_usage(choices, n),
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
    )


def echoed(prompt: str, choice: ChoiceOutput) -> ChoiceOutput:
    """`choice` with its prompt in front of its text, and in front of its logprobs when it
    has them: OpenAI's `echo`."""
    logprobs = choice.logprobs
    if logprobs is not None:
        logprobs = (*(choice.prompt_logprobs or ()), *logprobs)
    return dataclasses.replace(choice, text=prompt + choice.text, logprobs=logprobs)


class CompletionStream(ChunkStream[CompletionResponseChoice]):
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


class CompletionsEndpoint(OpenAIEndpoint):
    """A batch of prompts, each tokenized as it is (its special tokens parsed)."""

    id_prefix = "cmpl"
    prompt_param = "prompt"
    body: CompletionRequest
    stream_type = CompletionStream

    prompt_texts: Sequence[str] = ()
    """With `echo`: each prompt as text (set by `tokenize`)."""

    @property
    def num_prompts(self) -> int:
        return len(self.body.prompt)

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        tokenizer = state.tokenizer
        prompts = tokenize_prompts(self.body, tokenizer, vocab_size)
        if self.body.echo:
            texts = self.body.prompt
            self.prompt_texts = [
                text if isinstance(text, str) else _decoded(tokenizer, ids)
                for text, ids in zip(texts, prompts)
            ]
        return prompts

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        """With `echo`, a choice's first chunk opens with its prompt (and its logprobs,
        which come with the choice's first output)."""
        if self.body.echo and out.index not in self.stream.text_offsets:
            prompt = self.prompt_texts[out.index // self.body.n]
            logprobs = (*out.prompt_logprobs, *out.logprobs) if acc.want_logprobs else ()
            out = dataclasses.replace(out, text=prompt + out.text, logprobs=logprobs)
        return super().events(out, choice, acc)

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        if self.body.echo:
            n = self.body.n
            choices = [echoed(self.prompt_texts[i // n], c) for i, c in enumerate(choices)]
        vllm_prompt = self.body.prompt_logprobs is not None
        return completion_response(self.header, choices, self.body.n, vllm_prompt).model_dump()


def _decoded(tokenizer: PreTrainedTokenizerBase | None, ids: list[int]) -> str:
    """A token-id prompt as text, for echo: "" on a server without a tokenizer."""
    if tokenizer is None:
        return ""
    text = tokenizer.decode(ids)
    assert isinstance(text, str), "one id list decodes to one text"
    return text
