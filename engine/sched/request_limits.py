"""What a request must satisfy to be queued at all: checked once, at `add_request`, so
that nothing waits in a queue that could never run."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.req import Req


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int
    max_total_tokens: int
    clip_max_new_tokens: int
    """max_new_tokens counts up to this in the KV estimate (`--clip-max-new-tokens`)."""
    stop_strings: bool
    """A tokenizer decodes outputs, so stop strings can match."""
    grammars: bool
    """A grammar backend compiles json_schema, regex and ebnf."""
    swa_max_total_tokens: int | None = None
    """A hybrid model's SWA pool, in tokens (None: one pool)."""
    swa_decode_tokens: int = 0
    """With an SWA pool: how many of a request's decoded tokens hold SWA slots at once at
    most (`CacheManager.swa_tokens_held_at_most`)."""

    def check(self, req: Req) -> None:
        """Raise ValueError naming the limit `req` breaks; clip its `max_new_tokens` to
        what the context leaves."""
        ids, params = req.origin_input_ids, req.sampling_params
        input_len = len(ids)
        if input_len == 0:
            raise ValueError("the prompt is empty")
        params.verify(self.vocab_size)
        if max(ids) >= self.vocab_size or min(ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        if (error := prompt_length_error(input_len, self.context_len)) is not None:
            raise ValueError(error)
        if (error := logprob_start_error(params.logprob_start_len, input_len)) is not None:
            raise ValueError(error)
        if params.stop and not self.stop_strings:
            raise ValueError(
                "stop strings need a tokenizer; this engine runs with skip_tokenizer_init"
            )
        params.max_new_tokens = min(params.max_new_tokens, self.context_len - input_len)
        needed = input_len + min(params.max_new_tokens, self.clip_max_new_tokens)
        if needed > self.max_total_tokens:
            raise ValueError(
                f"the prompt ({input_len} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"needs {needed} KV slots; the KV cache holds {self.max_total_tokens}. "
                "Lower max_tokens or raise --max-total-tokens"
            )
        if self.swa_max_total_tokens is not None:
            swa_needed = input_len + min(needed - input_len, self.swa_decode_tokens)
            if swa_needed > self.swa_max_total_tokens:
                raise ValueError(
                    f"the prompt ({input_len} tokens) needs {swa_needed} slots of the "
                    f"sliding-window KV pool, which holds {self.swa_max_total_tokens}. Shorten "
                    "the prompt or raise --max-total-tokens or --swa-full-tokens-ratio"
                )
        if params.grammar is not None and not self.grammars:
            raise ValueError(
                "json_schema, regex and ebnf need a tokenizer and a grammar backend; this "
                "engine runs with skip_tokenizer_init or --grammar-backend none"
            )


def prompt_length_error(prompt_len: int, context_len: int) -> str | None:
    """The context rule, as the engine and the tokenizer service both state it: a prompt
    must leave room for at least one generated token. None when `prompt_len` keeps it."""
    if prompt_len < context_len:
        return None
    return (
        f"the prompt has {prompt_len} tokens, but the context length is {context_len}: no "
        "room is left to generate"
    )


def logprob_start_error(
    logprob_start_len: int, prompt_len: int, param: str = "logprob_start_len"
) -> str | None:
    """The prompt-logprobs rule: they start inside the prompt. `param` is the field as the
    request names it. None when `logprob_start_len` keeps it."""
    if logprob_start_len < prompt_len:
        return None
    return f"{param} must be below the prompt length ({prompt_len}), got {logprob_start_len}"
