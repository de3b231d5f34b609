"""A grammar that starts after the reasoning section, as SGLang's ReasonerGrammarBackend.

Reasoning models (Qwen3, DeepSeek-R1) write `<think> … </think>` before the answer; a
json_schema, regex or ebnf constrains the answer only. Until the think-end token is
sampled the model writes freely; from the token after it, the grammar decides.
"""

from __future__ import annotations

import torch

from engine.grammar.matcher import GrammarMatcher


class ReasoningGrammarMatcher:
    """`GrammarMatcher`'s interface over `inner`, which sees only the tokens after
    `think_end_token_id`. The tokens of each phase are counted so that a rollback (a
    jump-forward's re-tokenization) may cross back into the reasoning section."""

    def __init__(self, inner: GrammarMatcher, think_end_token_id: int):
        self.inner = inner
        self.think_end_token_id = think_end_token_id
        self._reasoning_tokens = 0
        """Tokens accepted while reasoning, the think-end token included."""
        self._answer_tokens = 0
        """Tokens the inner matcher accepted."""
        self._answering = False

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Every token while reasoning (the row is set, not assumed, all-allowed)."""
        if self._answering:
            self.inner.fill_vocab_mask(vocab_mask, row)
        else:
            vocab_mask[row].fill_(-1)

    def accept_token(self, token: int) -> bool:
        """Any token while reasoning; after the think-end token, the grammar's."""
        if self._answering:
            if not self.inner.accept_token(token):
                return False
            self._answer_tokens += 1
            return True
        self._reasoning_tokens += 1
        self._answering = token == self.think_end_token_id
        return True

    def allows_any_token(self) -> bool:
        """True while reasoning; after it, whether the grammar can continue."""
        return not self._answering or self.inner.allows_any_token()

    def is_terminated(self) -> bool:
        """Only the grammar can end: a reasoning section never terminates it."""
        return self._answering and self.inner.is_terminated()

    def find_jump_forward_string(self) -> str:
        """Nothing is forced while reasoning."""
        return self.inner.find_jump_forward_string() if self._answering else ""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens: the answer's from the inner matcher,
        the rest from the reasoning section, reopening it if the think-end token goes."""
        if num_tokens > self._answer_tokens + self._reasoning_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: only "
                f"{self._answer_tokens + self._reasoning_tokens} were accepted"
            )
        from_answer = min(num_tokens, self._answer_tokens)
        if from_answer:
            self.inner.rollback(from_answer)
            self._answer_tokens -= from_answer
        from_reasoning = num_tokens - from_answer
        if from_reasoning:
            self._reasoning_tokens -= from_reasoning
            self._answering = False
