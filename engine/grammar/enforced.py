"""Which JSON-schema keywords the grammar enforces, and the refusal of those it does not.

xgrammar (0.2.9) turns a schema into a grammar keyword by keyword and skips what it cannot
express, logging at most a warning to the server's stderr: a schema with `if`/`then` is then
served as if the branch were absent, and the client gets an answer that does not validate.
`UNENFORCED` is what tests/engine/grammar/test_enforced.py finds by probing every keyword of
JSON Schema 2020-12 and draft 7: a small schema with the keyword, an instance it forbids, and
whether the grammar still admits that instance (or ignores the keyword: the grammar is the
same without it). A request may opt into that best effort; by default such a schema is
refused, naming the keyword and where it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.grammar.limits import GrammarError

UNENFORCED = frozenset(
    {
        "if",
        "then",
        "else",
        "not",
        "dependentSchemas",
        "dependentRequired",
        "dependencies",
        "unevaluatedItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "$dynamicRef",
        "$recursiveRef",
    }
)
"""Keywords the grammar ignores wherever they appear."""
ENFORCED = frozenset(
    {
        "type",
        "enum",
        "const",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "anyOf",
        "$ref",
    }
)
"""Keywords the grammar enforces; `allOf` (one schema) and `oneOf` (disjoint branches) too,
within the limits `unenforced_keywords` checks. `unevaluatedProperties` is read as
`additionalProperties` (enough: an `allOf` of several schemas is refused). Draft 7's
`additionalItems` applies only beside an array of `items`, which xgrammar refuses itself."""

_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
"""Keywords whose values are JSON data, never schemas."""
_SCHEMA_MAPS = frozenset(
    {"$defs", "definitions", "dependentSchemas", "patternProperties", "properties"}
)
"""Keywords whose values map names to schemas."""
_NUMBER_TYPES = frozenset({"integer", "number"})


def check_enforced(schema: Any) -> None:
    """Raise GrammarError naming the first keyword of `schema` xgrammar would not enforce,
    with its JSON pointer."""
    for keyword, path, why in unenforced_keywords(schema):
        raise _refusal(keyword, path, why)


def check_one_of(schema: Any) -> None:
    """Raise GrammarError naming the first `oneOf` of `schema` whose branches are not
    provably disjoint: llguidance, which refuses what else it does not implement, reads a
    `oneOf` as `anyOf` when asked to, which is exact only for disjoint branches."""
    for keyword, path, why in unenforced_keywords(schema):
        if keyword == "oneOf":
            raise _refusal(keyword, path, why)


def _refusal(keyword: str, path: str, why: str) -> GrammarError:
    return GrammarError(
        f"json_schema uses {keyword!r} at {path}{why}, which the grammar backend does not "
        "enforce: the answer could break it. Remove it, or send "
        '"json_schema_best_effort": true to be served without it'
    )


def unenforced_keywords(node: Any, path: str = "#") -> Iterator[tuple[str, str, str]]:
    """(keyword, JSON pointer, reason) for each keyword of the schema `node` the grammar
    would not enforce, depth first."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from unenforced_keywords(item, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{_escape(key)}"
        if key in _DATA_KEYWORDS:
            continue
        if key in UNENFORCED:
            yield key, where, ""
        elif key == "allOf" and isinstance(value, list) and len(value) > 1:
            yield key, where, " (more than one schema)"
        elif key == "oneOf" and isinstance(value, list) and not _disjoint(value):
            yield key, where, " (branches not provably disjoint: it would be served as anyOf)"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from unenforced_keywords(sub, f"{where}/{_escape(name)}")
        else:
            yield from unenforced_keywords(value, where)


def _disjoint(branches: list[Any]) -> bool:
    """No instance can match two of `branches`: their declared types, or their constant
    values, are pairwise disjoint (integer counting as a number)."""
    seen_types: set[str] = set()
    seen_values: list[Any] = []
    by_type = by_value = True
    for branch in branches:
        if not isinstance(branch, dict):
            return False
        types = _types(branch)
        by_type = by_type and types is not None and not (types & seen_types)
        seen_types |= types or set()
        values = _values(branch)
        by_value = by_value and values is not None and not any(v in seen_values for v in values)
        seen_values.extend(values or [])
    return by_type or by_value


def _types(branch: dict[str, Any]) -> set[str] | None:
    declared = branch.get("type")
    if isinstance(declared, str):
        declared = [declared]
    if not isinstance(declared, list) or not all(isinstance(t, str) for t in declared):
        return None
    types = set(declared)
    return types | _NUMBER_TYPES if types & _NUMBER_TYPES else types


def _values(branch: dict[str, Any]) -> list[Any] | None:
    if "const" in branch:
        return [branch["const"]]
    enum = branch.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _escape(key: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
