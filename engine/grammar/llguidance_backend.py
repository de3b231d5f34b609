"""llguidance behind the backend seam: its grammars (JSON schemas, regexes, Lark, and the
GBNF/EBNF the API takes, which it reads as Lark), its check for the tokenizer, and its
matcher.

llguidance computes a mask with a bounded amount of lexer work ("fuel"), so no grammar can
make one mask cost more than a bounded time, and it refuses the JSON-schema keywords it
does not implement instead of skipping them. A `oneOf` is refused too unless every one in
the schema has provably disjoint branches (`enforced`), where reading it as `anyOf` is
exact. JSON comes out as xgrammar writes it: no free whitespace, ", " and ": " between
items and keys.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance import LLMatcher
from transformers import PreTrainedTokenizerBase

from engine.grammar.cost import GrammarCostError
from engine.grammar.enforced import check_one_of
from engine.grammar.exact import without_nothing
from engine.grammar.limits import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

NAME = "llguidance"

_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "coerce_one_of": True,
}
"""`coerce_one_of`: reached only by a schema whose every `oneOf` is disjoint (checked first),
or one sent for best effort."""
_COST_STOPS = frozenset({"LexerTooComplex", "ParserTooComplex"})
_COST_WORDS = re.compile(r"too many|too complex|fuel")
"""llguidance's stop reasons for a grammar over its per-token budget, and the words of
its messages for one (a lexer over its budget stops as an "InternalError")."""
_OPEN_KEYWORDS = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
"""Keywords that say what an object's other properties may be."""
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
"""Keywords whose values are JSON data, never schemas."""


def _closed_objects(node: Any, merged: bool = False) -> Any:
    """The schema with `additionalProperties: false` on each object that says nothing of
    other properties, as xgrammar's strict mode reads it (JSON Schema's default allows
    them, and a small model then writes keys until max_tokens). The parts of an `allOf`
    (`merged`) stay open: each names only some of the properties the others allow."""
    if isinstance(node, list):
        return [_closed_objects(item, merged) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {
        key: value if key in _DATA_KEYWORDS else _closed_objects(value, merged=key == "allOf")
        for key, value in node.items()
    }
    if "properties" in closed and not merged and not _OPEN_KEYWORDS & closed.keys():
        closed["additionalProperties"] = False
    return closed


def grammar_text(kind: str, source: str, best_effort: bool = False) -> str:
    """llguidance's grammar for a `kind` grammar (not yet checked). With `best_effort`, a
    JSON schema's unimplemented keywords are skipped and every `oneOf` read as `anyOf`."""
    if kind == "json_schema":
        schema = without_nothing(json.loads(source), drop_forbidden=False)
        source = json.dumps(_closed_objects(schema))
        if not best_effort:
            check_one_of(json.loads(source))
        options: JsonCompileOptions = {**_JSON_OPTIONS, "lenient": best_effort}
        return LLMatcher.grammar_from_json_schema(source, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    if kind == "ebnf":
        try:
            return llguidance.grammar_from("ebnf", source)
        except Exception as e:  # the GBNF translator raises its own error types
            raise GrammarError(f"invalid ebnf: {e}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def check(kind: str, source: str, best_effort: bool = False) -> str:
    """The grammar text, or GrammarError with llguidance's reason: a parse, no vocabulary."""
    text = grammar_text(kind, source, best_effort)
    failed, messages = LLMatcher.validate_grammar_with_warnings(text, None)
    if failed:
        reason = "; ".join(m.strip() for m in messages) or "rejected"
        raise GrammarError(f"invalid {kind}: {reason}")
    return text


class LLGuidanceCompiler:
    """Grammars for one vocabulary: a compile builds a matcher at the grammar's start,
    which each request copies. It runs on the backend's threads: llguidance bounds the
    work of building a grammar (its parser limits) before it starts."""

    name = NAME

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None,
    ):
        stops = list(stop_token_ids or [])
        eos = stops if stops else tokenizer.eos_token_id
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer,  # type: ignore[arg-type]  # typed as the fast tokenizer it must be
            n_vocab=vocab_size,
            eos_token=eos,
        )
        self._stop_token_ids = frozenset(stops or [self._tokenizer.eos_token])
        self._vocab_size = vocab_size

    def compile(self, kind: str, source: str, on_start: Callable[[], None]) -> LLMatcher:
        """Best effort, as the worker serves every grammar: the tokenizer has refused what
        would not be enforced, unless the client asked for best effort."""
        on_start()
        matcher = LLMatcher(self._tokenizer, check(kind, source, best_effort=True))
        if matcher.is_error():
            raise GrammarError(f"invalid {kind}: {matcher.get_error()}")
        return matcher

    def new_matcher(self, compiled: LLMatcher) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self._stop_token_ids, self._vocab_size)

    def close(self) -> None:
        """Nothing runs besides: compiles are bounded by llguidance's limits, on threads."""


class LLGuidanceMatcher:
    """`GrammarMatcher` over llguidance's matcher. llguidance stops by itself where nothing
    can follow, and then refuses even a stop token; as xgrammar does, this matcher ends only
    once a stop token is accepted, taking it itself in that case (`_own_stop`)."""

    def __init__(self, matcher: LLMatcher, stop_token_ids: frozenset[int], vocab_size: int):
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._vocab_size = vocab_size
        self._terminated = False
        self._own_stop = False
        """The terminating stop token was taken here, not by llguidance."""

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """GrammarCostError once llguidance stopped on its per-token budget (a token it
        refused shows at `accept_token` instead)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, vocab_mask, row)
        if not self._matcher.is_error():
            return
        reason = self._matcher.get_error().splitlines()[0]
        if self._matcher.stop_reason() in _COST_STOPS or _COST_WORDS.search(reason):
            raise GrammarCostError(f"the grammar is too costly to follow here ({reason})")
        raise RuntimeError(f"llguidance: {reason}")

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if self._matcher.is_stopped():
            self._own_stop = self._terminated = (
                token in self._stop_token_ids and self._matcher.is_accepting()
            )
            return self._terminated
        if self._matcher.try_consume_tokens([token]) != 1:
            return False
        self._terminated = token in self._stop_token_ids
        return True

    def allows_any_token(self) -> bool:
        """llguidance offers the stop token at a dead end (its mask is never empty), and a
        character's first byte where the vocabulary cannot spell the rest: a token counts
        only if the matcher takes it, a stop token only where the grammar is complete."""
        if self._matcher.is_accepting():
            return True
        mask = llguidance.torch.allocate_token_bitmask(1, self._vocab_size)
        self.fill_vocab_mask(mask, 0)
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: self._vocab_size].nonzero().flatten().tolist()
        return any(
            self._matcher.validate_tokens([t]) == 1
            for t in allowed
            if t not in self._stop_token_ids
        )

    def is_terminated(self) -> bool:
        return self._terminated

    def find_jump_forward_string(self) -> str:
        if self._terminated or self._matcher.is_stopped():
            return ""
        forced = self._matcher.compute_ff_bytes()
        for cut in range(4):  # a forced run may end inside a character
            try:
                return forced[: len(forced) - cut].decode()
            except UnicodeDecodeError:
                continue
        return ""

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self._terminated = False
        if self._own_stop:
            self._own_stop = False
            num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)
