"""SGLang's native `/generate`: `n` is one of the `sampling_params`, an abort is a finish
reason rather than an error (native clients read it), each stream event is one prompt's
answer so far, and one prompt sent alone is answered with one object rather than a list."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.tokenizer.choice_output import ChoiceOutput, TokenLogprob, shown_or_none
from services.tokenizer.manager import ReqOutput
from services.tokenizer.protocol.native import GenerateRequest
from services.tokenizer.request_mapper import tokenize_prompts
from services.tokenizer.serving_base import AppState, ChoiceAccumulator, Endpoint
from services.tokenizer.sse import Chunk


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
        spec_verify_ct=output.spec_verify_ct,
        spec_accept_length=output.spec_accept_length,
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
    return [shown_or_none(lp.logprob), lp.token_id, lp.token]


def generate_progress(
    text: str,
    output_ids: Sequence[int],
    *,
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    spec_verify_ct: int | None = None,
    spec_accept_length: float | None = None,
) -> dict[str, Any]:
    """SGLang's native answer so far for a prompt still generating (a stream's event):
    the text and ids until now, and a null `finish_reason`. Under speculative decoding
    (the worker sends the values) it has SGLang's `spec_verify_ct` and `spec_accept_length`."""
    meta_info: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
        "finish_reason": None,
    }
    if spec_verify_ct is not None:
        meta_info["spec_verify_ct"] = spec_verify_ct
    if spec_accept_length is not None:
        meta_info["spec_accept_length"] = spec_accept_length
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta_info}


class GenerateEndpoint(Endpoint):
    """A batch of prompts, texts or token ids, with SGLang's native fields."""

    id_prefix = "gen"
    n_param = "sampling_params.n"
    body: GenerateRequest

    @property
    def prompt_param(self) -> str:
        return self.body.prompt_field

    @property
    def num_prompts(self) -> int:
        return len(self.body.prompts)

    @property
    def n(self) -> int:
        n = self.body.sampling_params.get("n", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) else 1

    def check_output(self, out: ReqOutput) -> None:
        """Nothing fails a native request: an abort is its finish reason."""

    def tokenize(self, state: AppState, vocab_size: int) -> list[list[int]]:
        return tokenize_prompts(self.body, state.tokenizer, vocab_size)

    def events(
        self, out: ReqOutput, choice: ChoiceOutput | None, acc: ChoiceAccumulator
    ) -> list[Chunk]:
        if choice is not None:
            answer = generate_response(choice)
        else:
            answer = generate_progress(
                acc.text(out.index),
                acc.output_ids(out.index),
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                cached_tokens=out.cached_tokens,
                spec_verify_ct=out.spec_verify_ct,
                spec_accept_length=out.spec_accept_length,
            )
        return [{**answer, "index": out.index}]

    def answer(self, choices: list[ChoiceOutput]) -> Any:
        results = [{**generate_response(c), "index": i} for i, c in enumerate(choices)]
        return results if self.body.is_batch or len(results) > 1 else results[0]
