"""Which JSON-schema keywords the grammar enforces, found by probing each keyword: a schema
with it, an instance the schema forbids, and whether the grammar (as served) admits that
instance or ignores the keyword (the same grammar without it). `enforced.UNENFORCED` must be
exactly what the probes find, and every keyword of the JSON Schema vocabularies is probed."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from engine.grammar import GrammarError
from engine.grammar.enforced import ENFORCED, UNENFORCED, check_enforced
from engine.grammar.strict_json import json_schema_grammar
from engine.grammar.validate import validate_grammar
from engine.model.tokenizer_cache import load_tokenizer

INT = {"type": "integer"}
OPEN_AB = {"type": "object", "properties": {"a": INT, "b": INT}, "additionalProperties": True}
"""Dependencies of an open object: a closed one's are rewritten into cases (`exact`)."""
OBJ_AB = {"type": "object", "properties": {"a": INT, "b": INT}}
PROBES: dict[str, tuple[dict, object]] = {
    "if": ({**OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "then": ({**OBJ_AB, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, {"a": 1}),
    "else": ({**OBJ_AB, "if": {"required": ["a"]}, "else": {"required": ["b"]}}, {}),
    "not": ({"type": "integer", "not": {"const": 1}}, 1),
    "dependentSchemas": ({**OPEN_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "dependentRequired": ({**OPEN_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependencies": ({**OPEN_AB, "dependencies": {"a": ["b"]}}, {"a": 1}),
    "unevaluatedProperties": (
        {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": {"type": "string"}},
        {"a": 1, "b": 2},
    ),
    "unevaluatedItems": ({"type": "array", "unevaluatedItems": INT}, ["x"]),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 1}}, [2]),
    "minContains": (
        {"type": "array", "items": INT, "contains": {"const": 1}, "minContains": 2},
        [1, 2],
    ),
    "maxContains": (
        {"type": "array", "items": INT, "contains": {"const": 1}, "maxContains": 1},
        [1, 1],
    ),
    "$dynamicRef": (
        {"$dynamicAnchor": "n", "type": "object", "properties": {"a": {"$dynamicRef": "#n"}}},
        {"a": 1},
    ),
    "$recursiveRef": (
        {"$recursiveAnchor": True, "type": "object", "properties": {"a": {"$recursiveRef": "#"}}},
        {"a": 1},
    ),
    "type": (INT, "x"),
    "enum": ({"enum": [1, 2]}, 3),
    "const": ({"const": 1}, 2),
    "properties": ({"type": "object", "properties": {"a": INT}}, {"a": "x"}),
    "required": ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, {}),
    "additionalProperties": ({"type": "object", "additionalProperties": INT}, {"a": "x"}),
    "patternProperties": (
        {"type": "object", "patternProperties": {"^a": INT}, "additionalProperties": False},
        {"a": "x"},
    ),
    "propertyNames": (
        {"type": "object", "additionalProperties": INT, "propertyNames": {"pattern": "^a"}},
        {"b": 1},
    ),
    "minProperties": ({**OBJ_AB, "minProperties": 1}, {}),
    "maxProperties": (
        {"type": "object", "additionalProperties": INT, "maxProperties": 1},
        {"a": 1, "b": 2},
    ),
    "items": ({"type": "array", "items": INT}, ["x"]),
    "prefixItems": ({"type": "array", "prefixItems": [INT], "items": False}, ["x"]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, [1]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [1, 2]),
    "minLength": ({"type": "string", "minLength": 2}, "a"),
    "maxLength": ({"type": "string", "maxLength": 2}, "abc"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "b"),
    "format": ({"type": "string", "format": "date"}, "2024-13-45"),
    "minimum": ({"type": "integer", "minimum": 3}, 2),
    "maximum": ({"type": "number", "maximum": 3.5}, 4.5),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 3),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, 3),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 4),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, "x"),
    "$ref": ({"$defs": {"i": INT}, "$ref": "#/$defs/i"}, "x"),
}
"""keyword -> (a schema using it, an instance that schema forbids)."""
DRAFT7 = {"dependencies", "$recursiveRef"}
"""Probed under draft 7 (2019-09 for $recursiveRef), where the keyword is defined."""
NOT_ASSERTIONS = {
    "$defs",
    "definitions",
    "$dynamicAnchor",
    "$recursiveAnchor",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
    "additionalItems",
}
"""Vocabulary entries that never make an instance invalid: nothing to enforce; and draft
7's `additionalItems`, which only applies beside an array of `items` (xgrammar refuses that
form: a 400, test below)."""


def validator(keyword: str, schema: dict) -> jsonschema.protocols.Validator:
    if keyword == "$recursiveRef":
        return jsonschema.Draft201909Validator(schema)
    if keyword in DRAFT7:
        return jsonschema.Draft7Validator(schema)
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer("embedded"), vocab_size=49152)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def admits(compiler: xgr.GrammarCompiler, schema: dict, instance: object) -> bool:
    matcher = xgr.GrammarMatcher(
        compiler.compile_grammar(json_schema_grammar(json.dumps(schema))),
        terminate_without_stop_token=True,
    )
    text = json.dumps(instance, separators=(", ", ": "))
    return matcher.accept_string(text) and matcher.is_terminated()


def ignored(schema: dict, keyword: str) -> bool:
    """The grammar is the same without `keyword`."""
    without = {k: v for k, v in schema.items() if k != keyword}
    try:
        return str(json_schema_grammar(json.dumps(schema))) == str(
            json_schema_grammar(json.dumps(without))
        )
    except Exception:  # xgrammar refuses one of the two: the keyword changed something
        return False


def every_keyword() -> set[str]:
    """The validation keywords of JSON Schema 2020-12, 2019-09 and draft 7 (jsonschema
    evaluates `then`/`else` inside `if`, `minContains`/`maxContains` inside `contains`)."""
    return (
        set(jsonschema.Draft202012Validator.VALIDATORS)
        | set(jsonschema.Draft201909Validator.VALIDATORS)
        | set(jsonschema.Draft7Validator.VALIDATORS)
        | {"then", "else", "minContains", "maxContains"}
    )


def test_every_keyword_of_the_vocabularies_is_probed():
    combinators = {"allOf", "oneOf"}  # enforced within limits: tests below
    assert every_keyword() - NOT_ASSERTIONS - combinators == set(PROBES)
    assert UNENFORCED | ENFORCED == set(PROBES) and not UNENFORCED & ENFORCED


@pytest.mark.parametrize("keyword", sorted(PROBES))
def test_the_probe_decides_whether_a_keyword_is_enforced(compiler, keyword):
    schema, instance = PROBES[keyword]
    assert not validator(keyword, schema).is_valid(instance)  # the probe itself is right
    unenforced = admits(compiler, schema, instance) or ignored(schema, keyword)
    assert unenforced == (keyword in UNENFORCED)


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({"allOf": [INT, {"minimum": 5}]}, 1),
        ({"oneOf": [INT, {"type": "number"}]}, 1),
    ],
    ids=["allOf of two", "oneOf overlapping"],
)
def test_what_the_combinators_refuse_the_grammar_would_break(compiler, schema, instance):
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    assert admits(compiler, schema, instance)
    with pytest.raises(GrammarError):
        check_enforced(schema)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        (
            {"type": "object", "allOf": [{"if": {"required": ["a"]}, "then": {}}]},
            "'if' at #/allOf/0/if",
        ),
        ({"properties": {"a/b": {"not": INT}}}, "'not' at #/properties/a~1b/not"),
        (
            {"$defs": {"d": {"dependentSchemas": {}}}},
            "'dependentSchemas' at #/$defs/d/dependentSchemas",
        ),
        (
            {"items": {"unevaluatedItems": False}},
            "'unevaluatedItems' at #/items/unevaluatedItems",
        ),
        ({"allOf": [INT, {"minimum": 1}]}, "'allOf' at #/allOf (more than one schema)"),
        (
            {"oneOf": [INT, {"type": "number"}]},
            "'oneOf' at #/oneOf (branches not provably disjoint",
        ),
        (  # an object may hold both keys
            {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
            "'oneOf' at #/oneOf (branches not provably disjoint",
        ),
        (  # "x" is not an object: both branches admit it
            {"oneOf": [{"required": ["a"]}, {"properties": {}, "additionalProperties": False}]},
            "'oneOf' at #/oneOf (branches not provably disjoint",
        ),
        (
            {"$defs": {"n": INT}, "oneOf": [{"$ref": "#/$defs/n"}, {"type": "number"}]},
            "'oneOf' at #/oneOf (branches not provably disjoint",
        ),
    ],
)
def test_an_unenforced_keyword_is_refused_with_its_path_unless_best_effort(schema, message):
    source = json.dumps(schema)
    with pytest.raises(GrammarError, match="^json_schema uses " + re.escape(message)):
        validate_grammar("json_schema", source, 65536, 64, backend="xgrammar")
    validate_grammar("json_schema", source, 65536, 64, best_effort=True, backend="xgrammar")


@pytest.mark.parametrize(
    "schema",
    [
        {"properties": {"if": INT, "not": {"type": "string"}}, "required": ["if"]},
        {"enum": [{"if": 1}], "default": {"not": 2}, "examples": [{"then": 3}]},
        {"allOf": [{"type": "object", "properties": {"a": INT}}]},
        {"oneOf": [{"type": "string"}, INT, {"type": "null"}]},
        {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
        {"anyOf": [INT, {"type": "number"}]},
        {
            "definitions": {"path": {"type": "string"}, "list": {"$ref": "#/definitions/l"}},
            "$defs": {},
            "oneOf": [{"$ref": "#/definitions/path"}, {"type": "null"}, {"$ref": "#/x"}],
            "x": {"type": "array"},
        },
        {
            "oneOf": [
                {"type": "object", "required": ["a"], "properties": {"a": INT}},
                {
                    "type": "object",
                    "properties": {"b": INT},
                    "additionalProperties": False,
                    "required": ["b"],
                },
                {"type": "string"},
            ]
        },
        {  # untyped branches under an object-only parent (WashingtonPost's distributor)
            "type": "object",
            "oneOf": [
                {"properties": {"mode": {"enum": ["custom"]}}, "additionalProperties": False},
                {
                    "properties": {"mode": {"enum": ["reference"]}, "id": INT},
                    "additionalProperties": False,
                    "required": ["id", "mode"],
                },
            ],
        },
        {  # objects told apart by a required key's value (hayson's number / numberSpecial)
            "oneOf": [
                {
                    "type": "object",
                    "required": ["kind", "val"],
                    "properties": {"kind": {"enum": ["number"]}, "val": {"type": "number"}},
                },
                {
                    "type": "object",
                    "required": ["kind", "val"],
                    "properties": {"kind": {"enum": ["number"]}, "val": {"type": "string"}},
                },
                {"type": "object", "properties": {"kind": {"enum": ["dict"]}}},
            ]
        },
    ],
    ids=[
        "keywords as property names",
        "keywords as data",
        "allOf of one",
        "oneOf by type",
        "oneOf by value",
        "anyOf overlapping",
        "oneOf by the types $refs point to",
        "oneOf by a required key the other forbids",
        "oneOf by a required key, objects by the parent's type",
        "oneOf by a required key's value",
    ],
)
def test_schemas_with_only_enforced_keywords_pass(schema):
    validate_grammar("json_schema", json.dumps(schema), 65536, 64, backend="xgrammar")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "minItems": 1},
        {"type": ["array", "null"], "minItems": 2, "maxItems": 3},
        {"type": "array", "prefixItems": [INT], "minItems": 2},
    ],
)
def test_arrays_with_min_items_and_no_items_are_served_with_any_items(compiler, schema):
    validate_grammar("json_schema", json.dumps(schema), 65536, 64, backend="xgrammar")
    assert admits(compiler, schema, [1, "x", None][: schema["minItems"]])
    assert not admits(compiler, schema, [])


def test_draft7_tuple_items_with_additional_items_are_refused():
    schema = {"type": "array", "items": [INT], "additionalItems": False}
    with pytest.raises(GrammarError, match="items must be a boolean or an object"):
        validate_grammar("json_schema", json.dumps(schema), 65536, 64, backend="xgrammar")


def test_a_oneof_of_a_recursive_schema_is_judged_in_bounded_time():
    node = {"type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}
    schema = {**node, "oneOf": [node, node]}  # the same branch twice: never apart
    with pytest.raises(GrammarError, match="oneOf"):
        validate_grammar("json_schema", json.dumps(schema), 65536, 64, backend="xgrammar")
