"""What a grammar must pass before it is compiled: size, nesting, syntax, and for a JSON
schema that the grammar enforces every keyword it uses (`enforced`) unless the client asked
for best effort.

The tokenizer runs this to answer a bad grammar with a 400 before the request is queued
(and before SSE headers go out). Parsing with xgrammar needs no vocabulary and takes about
a millisecond where compiling the token masks takes far longer, so the worker's compile
only fails on what a parse cannot see, or on its timeout.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

import xgrammar as xgr

from engine.grammar.enforced import check_enforced
from engine.grammar.limits import GrammarError, check_grammar_limits
from engine.grammar.strict_json import json_schema_grammar

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's messages start with "[time] source.cc:line: ", which tells a client nothing."""

_PARSERS: dict[str, Callable[[str], xgr.Grammar]] = {
    "json_schema": json_schema_grammar,
    "regex": xgr.Grammar.from_regex,
    "ebnf": xgr.Grammar.from_ebnf,
}


def grammar_error(kind: str, exc: Exception) -> GrammarError:
    """xgrammar's complaint about a `kind` grammar, in words for the client."""
    return GrammarError(f"invalid {kind}: {_XGRAMMAR_LOG_PREFIX.sub('', str(exc)).strip()}")


@functools.lru_cache(maxsize=256)
def validate_grammar(
    kind: str, source: str, max_bytes: int, max_depth: int, best_effort: bool = False
) -> None:
    """Raise GrammarError if `source` is over the limits, does not parse as a `kind`, or
    (without `best_effort`) is a JSON schema using a keyword the grammar would not enforce.
    Cached: clients repeat one schema across requests (failures are not cached)."""
    check_grammar_limits(kind, source, max_bytes, max_depth)
    parse = _PARSERS.get(kind)
    if parse is None:
        raise GrammarError(f"unknown grammar kind {kind!r}")
    if kind == "json_schema" and not best_effort:
        check_enforced(json.loads(source))
    try:
        parse(source)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses for bad input
        raise grammar_error(kind, e) from None
