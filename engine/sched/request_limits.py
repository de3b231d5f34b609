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
        if input_len >= self.context_len:
            raise ValueError(
                f"the prompt has {input_len} tokens; the context length is {self.context_len}"
            )
        if params.logprob_start_len >= input_len:
            raise ValueError(
                f"logprob_start_len must be below the prompt length ({input_len}), "
                f"got {params.logprob_start_len}"
            )
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
        if params.grammar is not None and not self.grammars:
            raise ValueError(
                "json_schema, regex and ebnf need a tokenizer and a grammar backend; this "
                "engine runs with skip_tokenizer_init or --grammar-backend none"
            )
