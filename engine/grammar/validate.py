"""Which library serves a grammar, and the tokenizer's check that it can: `--grammar-backend
auto` takes xgrammar where it enforces the grammar (its masks are the cheaper for ordinary
schemas, and its JSON strings are made strict: `strict_json`), else llguidance where it
does (`allOf`, and what else it implements that xgrammar skips), else refuses the grammar
with xgrammar's reason and llguidance's; a best-effort JSON schema goes to llguidance,
which then skips what it does not implement. A JSON schema with a length-bounded string
goes to llguidance first: xgrammar's masks inside one cost 10-20 ms a token, llguidance's
well under one (docs/benchmarks/grammar.md). A regex or EBNF whose nested counted repeats
would make xgrammar's masks grow with every token (`cost`) goes to llguidance, whose lexer
works on a fixed budget per token.

The tokenizer runs this to answer a bad grammar with a 400 before the request is queued
(and before SSE headers go out), and the worker to pick the same library: both parse
without a vocabulary, in about a millisecond.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import engine.grammar.llguidance_backend as llguidance_backend
import engine.grammar.xgrammar_backend as xgrammar_backend
from engine.grammar.cost import check_mask_cost
from engine.grammar.enforced import check_enforced
from engine.grammar.exact import without_nothing
from engine.grammar.limits import GrammarError, check_grammar_limits

BACKENDS = (xgrammar_backend.NAME, llguidance_backend.NAME)


def check_library(library: str, kind: str, source: str, best_effort: bool = False) -> None:
    """Raise GrammarError unless `library` parses `source` and (without `best_effort`)
    enforces every keyword of a JSON schema."""
    if library == llguidance_backend.NAME:
        llguidance_backend.check(kind, source, best_effort)
        return
    if kind == "json_schema" and not best_effort:
        check_enforced(without_nothing(json.loads(source), drop_forbidden=True))
    xgrammar_backend.parse(kind, source)
    check_mask_cost(kind, source)


@functools.lru_cache(maxsize=256)
def choose_backend(kind: str, source: str, max_bytes: int, max_depth: int) -> str:
    """auto's library for a grammar within the limits: the first of xgrammar and llguidance
    (llguidance and xgrammar for a schema with a length-bounded string) that enforces it,
    else llguidance (best effort). Cached: clients repeat one schema."""
    check_grammar_limits(kind, source, max_bytes, max_depth)
    order = [xgrammar_backend.NAME, llguidance_backend.NAME]
    if kind == "json_schema" and _bounds_a_length(json.loads(source)):
        order.reverse()
    for library in order:
        try:
            check_library(library, kind, source)
        except GrammarError:
            continue
        return library
    return llguidance_backend.NAME


def _bounds_a_length(node: Any) -> bool:
    """Whether a schema holds `minLength` or `maxLength` anywhere (as a keyword or not: a
    property of that name only costs a string the faster library)."""
    if isinstance(node, dict):
        return (
            "minLength" in node
            or "maxLength" in node
            or any(_bounds_a_length(value) for value in node.values())
        )
    if isinstance(node, list):
        return any(_bounds_a_length(item) for item in node)
    return False


@functools.lru_cache(maxsize=256)
def validate_grammar(
    kind: str,
    source: str,
    max_bytes: int,
    max_depth: int,
    best_effort: bool = False,
    backend: str = "auto",
) -> str:
    """The library that will serve `source`, or GrammarError if it is over the limits,
    does not parse, or (without `best_effort`) uses a JSON-schema keyword no allowed
    library enforces (auto: xgrammar's reason, then llguidance's). Cached (failures are
    not)."""
    check_grammar_limits(kind, source, max_bytes, max_depth)
    if kind not in ("json_schema", "regex", "ebnf"):
        raise GrammarError(f"unknown grammar kind {kind!r}")
    if backend != "auto":
        check_library(backend, kind, source, best_effort)
        return backend
    library = choose_backend(kind, source, max_bytes, max_depth)
    try:
        check_library(library, kind, source, best_effort)
    except GrammarError as e:
        try:  # xgrammar's reason names the keyword and where it is
            check_library(xgrammar_backend.NAME, kind, source, best_effort)
        except GrammarError as preferred:
            raise GrammarError(f"{preferred} (llguidance: {e})") from None
        return xgrammar_backend.NAME
    return library
