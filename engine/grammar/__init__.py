"""Constrained decoding: json_schema / regex / ebnf compiled off the scheduler loop by
xgrammar (in killable processes) or llguidance; each constrained request carries a matcher
that masks the vocabulary per step."""

from engine.grammar.backend import (
    GrammarBackend,
    GrammarError,
    GrammarObserver,
    PendingGrammar,
    allocate_vocab_mask,
)
from engine.grammar.limits import check_grammar_limits
from engine.grammar.matcher import GrammarMatcher
from engine.grammar.reasoning import ReasoningGrammarMatcher

__all__ = [
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "GrammarObserver",
    "PendingGrammar",
    "ReasoningGrammarMatcher",
    "allocate_vocab_mask",
    "check_grammar_limits",
]
