"""One request's position in its grammar: the interface every backend's matcher offers
(SGLang's grammar object), which the scheduler, jump-forward and speculative drafts use."""

from __future__ import annotations

from typing import Protocol

import torch


class GrammarMatcher(Protocol):
    """Fill the mask for the next token, accept the sampled one, report termination."""

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `vocab_mask[row]` (int32, token t is bit
        t % 32 of word t // 32, 1 = allowed: both libraries' layout)."""

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (state unchanged)."""

    def allows_any_token(self) -> bool:
        """False when no token of the vocabulary continues the grammar from here: the
        client's grammar needs text this tokenizer cannot spell. Off the hot path: only
        asked once a sampled token was refused."""

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next ("" if the next token is a real choice)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (jump-forward re-tokenizes them)."""
