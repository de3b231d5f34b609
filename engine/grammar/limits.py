"""Size and nesting limits checked before a grammar reaches the compiler.

The tokenizer parses every grammar on its event loop, and xgrammar recurses natively over
nested rules, so a very large or deeply nested grammar could hold that loop for long or
exhaust its stack. These checks are cheap and run before any parse or compile.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


class GrammarError(ValueError):
    """A grammar the client must fix: becomes that request's 400, never a server error."""

    reason = "invalid"
    """Why, in a word for the refusals metric (subclasses say otherwise)."""


class GrammarLimitError(GrammarError):
    """Over the size or nesting limits."""

    reason = "limits"


def check_grammar_limits(kind: str, source: str, max_bytes: int, max_depth: int) -> None:
    """Raise GrammarError if `source` is larger than `max_bytes` (UTF-8) or nests deeper
    than `max_depth`: JSON containers for a json_schema, brackets for a regex or an ebnf."""
    size = len(source.encode())
    if size > max_bytes:
        raise GrammarLimitError(f"{kind} is {size} bytes; the limit is {max_bytes}")
    if kind == "json_schema":
        try:
            depth = json_depth(json.loads(source))
        except (json.JSONDecodeError, RecursionError) as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    else:
        depth = bracket_depth(source, quoted_strings=kind == "ebnf")
    if depth > max_depth:
        raise GrammarLimitError(f"{kind} nests {depth} levels deep; the limit is {max_depth}")


def json_depth(value: Any) -> int:
    """Nesting depth of JSON containers (a scalar is 0, `{}` is 1), without recursion."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        children: Iterable[Any]
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level + 1)
        stack.extend((child, level + 1) for child in children)
    return depth


def bracket_depth(source: str, quoted_strings: bool) -> int:
    """Deepest nesting of `(` and `{` in a regex or EBNF source. Escaped characters and
    character classes `[...]` do not nest; with `quoted_strings` (EBNF), neither do the
    contents of "..." literals."""
    depth = deepest = 0
    in_class = in_string = False
    chars = iter(source)
    for ch in chars:
        if ch == "\\":
            next(chars, None)
        elif in_class:
            in_class = ch != "]"
        elif in_string:
            in_string = ch != '"'
        elif ch == '"' and quoted_strings:
            in_string = True
        elif ch == "[":
            in_class = True
        elif ch in "({":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")}":
            depth = max(depth - 1, 0)
    return deepest
