"""Draft trees under a request's grammar: only drafts the grammar allows are verified, and
each node's row is masked with the grammar's state after that node's path.

Both walk the tree depth-first on the request's own matcher, accepting a child's token
on the way down and rolling it back on the way up, so the matcher ends where it began.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.speculative.draft_tree import DraftTree


class Matcher(Protocol):
    """What of a grammar matcher the tree walks use (`engine.grammar`'s matchers)."""

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> None: ...


def constrain(tree: DraftTree, matcher: Matcher) -> DraftTree:
    """The subtree of `tree` whose every draft the grammar accepts after its path (none
    after a token that ends the grammar)."""
    kept = DraftTree.root(tree.tokens[0])

    def visit(node: int, at: int) -> None:
        if matcher.is_terminated():
            return
        for token, child in tree.children[node].items():
            if matcher.accept_token(token):
                visit(child, kept.add(at, token))
                matcher.rollback(1)

    visit(0, 0)
    return kept


def fill_tree_masks(
    tree: DraftTree, matcher: Matcher, vocab_mask: torch.Tensor, start: int
) -> None:
    """Row `start + node` of `vocab_mask` gets the tokens the grammar allows after node's
    path, for every node (its drafts are grammar-valid: `constrain`)."""

    def visit(node: int) -> None:
        matcher.fill_vocab_mask(vocab_mask, start + node)
        for token, child in tree.children[node].items():
            if not matcher.accept_token(token):
                raise RuntimeError(f"draft token {token} is outside the grammar")
            visit(child)
            matcher.rollback(1)

    visit(0)
