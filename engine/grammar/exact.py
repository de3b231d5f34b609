"""JSON-schema forms rewritten into ones both libraries enforce, where the rewrite is exact,
so that a schema using them is served rather than refused.

- `{"not": {}}` (or a `not` of every type) matches no value: it is the schema `false` (a
  branch of an `anyOf` or `oneOf` that adds nothing, left out), and
  a property whose schema is `false` is one the object must not have (WashingtonPost's
  schemas forbid keys so). llguidance reads `false` itself; xgrammar refuses it, so for
  xgrammar the property is left out of an object closed to other keys instead, which
  forbids it as well.
- An `enum` beside a `type` keeps the values of that type only (`false` if none).
- A required key an open object does not list in `properties` is listed, as any value.
- `dependencies` (draft 7; `dependentRequired` and `dependentSchemas` since 2019-09) of a
  closed object with a few optional keys: each key is either absent (forbidden, as above)
  or present with what it demands (keys made required; a schema's `properties` and
  `required` merged in), so the object is the `anyOf` of every such case (2^k for k
  keys, at most `MAX_DEPENDENCIES`).
"""

from __future__ import annotations

from typing import Any

_ANNOTATIONS = frozenset(
    {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly"}
)
"""Keywords that constrain nothing."""
_EVERY_TYPE = frozenset({"null", "boolean", "object", "array", "number", "string"})
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
"""Keywords whose values are JSON data, never schemas."""
_DEPENDENCY_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas")
MAX_DEPENDENCIES = 4
"""Keys with dependencies expanded in one object (into at most 16 cases)."""


def matches_nothing(node: Any) -> bool:
    """Whether `node` is `false`, or holds a `not` of a schema every value matches (its
    other keywords can only narrow nothing further)."""
    if node is False:
        return True
    if not isinstance(node, dict) or "not" not in node:
        return False
    inner = node["not"]
    if inner is True or (isinstance(inner, dict) and set(inner) <= _ANNOTATIONS):
        return True
    if isinstance(inner, dict) and set(inner) - _ANNOTATIONS == {"type"}:
        types = inner["type"]
        return _EVERY_TYPE <= ({types} if isinstance(types, str) else set(types))
    return False


def _declare_required(node: dict[str, Any]) -> None:
    """A required key that `properties` does not list, in an object open to other keys,
    may hold any value: it is listed as `{}`, since both libraries close an object that
    says nothing of other keys and would then drop the requirement or the key."""
    required = node.get("required")
    if not isinstance(required, list) or node.get("additionalProperties", True) is False:
        return
    properties = node.get("properties", {})
    if not isinstance(properties, dict) or "patternProperties" in node:
        return
    missing = [k for k in required if isinstance(k, str) and k not in properties]
    if missing:
        node["properties"] = {**properties, **{k: {} for k in missing}}


def _enum_of_its_type(node: dict[str, Any]) -> dict[str, Any] | bool:
    """An `enum` beside a `type` keeps only the values of that type (both must hold; the
    libraries read one or the other), and is `false` when none is left."""
    values, types = node.get("enum"), node.get("type")
    if not isinstance(values, list) or types is None:
        return node
    names = {types} if isinstance(types, str) else set(types)
    kept = [v for v in values if _json_type(v) & names]
    if not kept:
        return False
    return node if len(kept) == len(values) else {**node, "enum": kept}


def _json_type(value: Any) -> set[str]:
    """The JSON Schema types `value` has ("integer" is a "number" too)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"}


def without_nothing(node: Any, drop_forbidden: bool) -> Any:
    """`node` with every schema that matches nothing written `false`; with
    `drop_forbidden`, a property whose schema is `false` left out of an object closed to
    other keys (no `additionalProperties` or false, no `patternProperties`), unless it is
    required (then nothing matches the object, which the library is left to say)."""
    if isinstance(node, list):
        return [without_nothing(item, drop_forbidden) for item in node]
    if not isinstance(node, dict):
        return node
    if matches_nothing(node):
        return False
    node = _enum_of_its_type(node)
    if node is False:
        return False
    expanded = _expand_dependencies(node)
    if expanded is not None:
        return without_nothing(expanded, drop_forbidden)
    rewritten = {
        key: value if key in _DATA_KEYWORDS else without_nothing(value, drop_forbidden)
        for key, value in node.items()
    }
    _declare_required(rewritten)
    for key in ("anyOf", "oneOf"):  # a branch that matches nothing adds nothing
        branches = rewritten.get(key)
        if (
            isinstance(branches, list)
            and False in branches
            and any(b is not False for b in branches)
        ):
            rewritten[key] = [b for b in branches if b is not False]
    properties = rewritten.get("properties")
    closed = rewritten.get("additionalProperties", False) is False
    if drop_forbidden and isinstance(properties, dict) and closed:
        if "patternProperties" not in rewritten:
            required = set(rewritten.get("required", ()))
            rewritten["properties"] = {
                k: v for k, v in properties.items() if v is not False or k in required
            }
    return rewritten


def _expand_dependencies(node: dict[str, Any]) -> dict[str, Any] | None:
    """The `anyOf` of a closed object's dependency cases, or None where that would not be
    exact (an open object, a required key with dependencies, a schema dependency with more
    than `properties` and `required`, properties that do not merge) or too large."""
    dependencies: dict[str, Any] = {}
    for keyword in _DEPENDENCY_KEYWORDS:
        value = node.get(keyword)
        if value is not None:
            if not isinstance(value, dict):
                return None
            dependencies.update(value)
    properties = node.get("properties")
    if (
        not dependencies
        or len(dependencies) > MAX_DEPENDENCIES
        or not isinstance(properties, dict)
        or node.get("additionalProperties", False) is not False
        or "patternProperties" in node
        or set(dependencies) & set(node.get("required", ()))
    ):
        return None
    base = {k: v for k, v in node.items() if k not in _DEPENDENCY_KEYWORDS}
    cases: list[dict[str, Any]] = [base]
    for key, demand in dependencies.items():
        absent = [_with_property(case, key, False) for case in cases]
        present = [_demanding(case, key, demand) for case in cases]
        if any(case is None for case in present):
            return None
        cases = [*absent, *(case for case in present if case is not None)]
    return {"anyOf": cases}


def _with_property(case: dict[str, Any], key: str, schema: Any) -> dict[str, Any]:
    return {**case, "properties": {**case["properties"], key: schema}}


def _demanding(case: dict[str, Any], key: str, demand: Any) -> dict[str, Any] | None:
    """`case` with `key` present and what it demands, None if that does not merge."""
    if isinstance(demand, list) and all(isinstance(k, str) for k in demand):
        required, merged = [key, *demand], case["properties"]
    elif isinstance(demand, dict) and set(demand) - _ANNOTATIONS <= {"properties", "required"}:
        required = [key, *demand.get("required", ())]
        merged = dict(case["properties"])
        for name, schema in demand.get("properties", {}).items():
            both = _merged(merged.get(name, {}), schema)
            if both is None:
                return None
            merged[name] = both
    else:
        return None
    names = [*case.get("required", ()), *(k for k in required if k not in case.get("required", ()))]
    return {**case, "properties": merged, "required": list(dict.fromkeys(names))}


def _merged(a: Any, b: Any) -> Any:
    """Two schemas' conjunction where it is the union of their keywords (no keyword given
    two different values, annotations aside), else None."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return None
    merged = dict(a)
    for key, value in b.items():
        if key in merged and merged[key] != value and key not in _ANNOTATIONS:
            return None
        merged.setdefault(key, value)
    return merged
