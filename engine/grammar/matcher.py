"""One request's position in its grammar (xgrammar's matcher behind SGLang's interface)."""

from __future__ import annotations

import torch
import xgrammar as xgr


class GrammarMatcher:
    """One request's position in its grammar, as SGLang's grammar object: fill the mask
    for the next token, accept the sampled one, report termination."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size: int = compiled.tokenizer_info.vocab_size

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `vocab_mask[row]` (xgrammar's int32 layout)."""
        self._matcher.fill_next_token_bitmask(vocab_mask, row)

    def accept_token(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (state unchanged)."""
        return self._matcher.accept_token(token)

    def allows_any_token(self) -> bool:
        """False when no token of the vocabulary continues the grammar from here: the
        client's grammar needs text this tokenizer cannot spell. Off the hot path: only
        asked once a sampled token was refused."""
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        self._matcher.fill_next_token_bitmask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bool(bits.flatten()[: self._vocab_size].any())

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted."""
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        """The text the grammar forces next ("" if the next token is a real choice)."""
        return self._matcher.find_jump_forward_string()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (jump-forward re-tokenizes them)."""
        self._matcher.rollback(num_tokens)
