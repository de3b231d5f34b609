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


def unenforced_keywords(
    node: Any, path: str = "#", root: Any = None
) -> Iterator[tuple[str, str, str]]:
    """(keyword, JSON pointer, reason) for each keyword of the schema `node` the grammar
    would not enforce, depth first; `root` is the whole schema, which local `$ref`s read."""
    root = node if root is None else root
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from unenforced_keywords(item, f"{path}/{i}", root)
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
        elif key == "oneOf" and isinstance(value, list) and not _disjoint(value, root, node):
            yield key, where, " (branches not provably disjoint: it would be served as anyOf)"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from unenforced_keywords(sub, f"{where}/{_escape(name)}", root)
        else:
            yield from unenforced_keywords(value, where, root)


def _disjoint(branches: list[Any], root: Any, parent: dict[str, Any]) -> bool:
    """No instance can match two of `branches`: each pair is told apart by its declared
    types (integer counting as a number), its constant values, or, where one branch or the
    `parent` schema holding the `oneOf` admits objects only, a key one requires and the
    other forbids, or a key one requires whose schemas in the two are apart. A branch
    that is a local `$ref` is read where it points."""
    resolved = [_resolve(branch, root) for branch in branches]
    if not all(isinstance(branch, dict) for branch in resolved):
        return False
    objects = _types(parent) == {"object"}
    return all(
        _apart(a, b, objects, root) for i, a in enumerate(resolved) for b in resolved[i + 1 :]
    )


def _apart(a: dict[str, Any], b: dict[str, Any], objects: bool, root: Any, depth: int = 0) -> bool:
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None:
        if not any(v in values_b for v in values_a):
            return True
    objects_only = objects or types_a == {"object"} or types_b == {"object"}
    return objects_only and (
        _forbids_a_required_key(a, b)
        or _forbids_a_required_key(b, a)
        or (depth < _MAX_PROPERTY_DEPTH and _discriminated(a, b, root, depth + 1))
    )


def _discriminated(a: dict[str, Any], b: dict[str, Any], root: Any, depth: int) -> bool:
    """One requires a key whose schema and the other's schema for that key are apart
    (`"Type": {"enum": ["Form"]}` against `{"enum": ["Http"]}`, or `"val"` a number
    against a string): an object matching one has a value there the other refuses."""
    return _requires_apart(a, b, root, depth) or _requires_apart(b, a, root, depth)


def _requires_apart(
    requiring: dict[str, Any], other: dict[str, Any], root: Any, depth: int
) -> bool:
    required = requiring.get("required")
    props, other_props = requiring.get("properties"), other.get("properties")
    if not (
        isinstance(required, list) and isinstance(props, dict) and isinstance(other_props, dict)
    ):
        return False
    for key in required:
        if not isinstance(key, str) or key not in props or key not in other_props:
            continue
        mine, theirs = _resolve(props[key], root), _resolve(other_props[key], root)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            if _apart(mine, theirs, objects=False, root=root, depth=depth):
                return True
    return False


def _forbids_a_required_key(requiring: dict[str, Any], forbidding: dict[str, Any]) -> bool:
    """`forbidding` admits no other properties than its own, and `requiring` requires one
    of those others: an object matching one cannot match the other."""
    required = requiring.get("required")
    properties = forbidding.get("properties", {})
    if (
        forbidding.get("additionalProperties") is not False
        or forbidding.get("patternProperties")
        or not isinstance(required, list)
        or not isinstance(properties, dict)
    ):
        return False
    return any(isinstance(key, str) and key not in properties for key in required)


_MAX_PROPERTY_DEPTH = 8
"""Required properties looked into, nested, to tell two branches apart (a recursive schema
would otherwise be followed without end)."""
_MAX_REF_HOPS = 16
"""A chain of `$ref`s longer than this (or a cycle) is not followed."""


def _resolve(branch: Any, root: Any) -> Any:
    """`branch`, or where its local `$ref` points when it is nothing else (a title or a
    description beside it aside); the branch itself where the pointer does not resolve."""
    node = branch
    for _ in range(_MAX_REF_HOPS):
        if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
            return node
        if set(node) - {"$ref", "title", "description", "$comment"}:
            return node
        target = _pointer(root, node["$ref"])
        if target is None:
            return node
        node = target
    return branch


def _pointer(root: Any, ref: str) -> Any:
    """The node at local JSON pointer `ref` ("#/definitions/x"), or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for token in ref[2:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


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
