"""Schema forms rewritten exactly into ones both libraries enforce: `not` of everything as
`false` (a forbidden property; an `anyOf` branch left out) and `dependencies` as the
`anyOf` of their cases. Exact means every instance gets the same verdict from the
`jsonschema` package before and after; and the rewritten schema is served."""

import itertools
import json

import jsonschema
import pytest

from engine.grammar.exact import matches_nothing, without_nothing
from engine.grammar.validate import check_library, validate_grammar

NOTHING = [{"not": {}}, {"not": True}, {"not": {"description": "x"}}, False]
EVERY_TYPE = {"type": ["string", "number", "array", "object", "boolean", "null"]}


def verdicts(schema, instances):
    validator = jsonschema.Draft7Validator(schema)
    return [validator.is_valid(i) for i in instances]


def objects(keys, values=("a", 1)):
    """Every object over `keys` (each absent or one of `values`)."""
    for choice in itertools.product([None, *values], repeat=len(keys)):
        yield {k: v for k, v in zip(keys, choice) if v is not None}


@pytest.mark.parametrize("node", [*NOTHING, {"not": EVERY_TYPE, "typeof": "function"}])
def test_a_not_of_everything_matches_nothing(node):
    assert matches_nothing(node)


@pytest.mark.parametrize("node", [{"not": {"type": "string"}}, {}, {"type": "null"}])
def test_other_schemas_match_something(node):
    assert not matches_nothing(node)


def test_a_forbidden_property_is_false_for_llguidance_and_left_out_of_a_closed_object():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"not": {}}},
        "additionalProperties": False,
    }
    assert without_nothing(schema, drop_forbidden=False)["properties"]["b"] is False
    for drop in (False, True):
        rewritten = without_nothing(schema, drop_forbidden=drop)
        instances = list(objects(["a", "b", "c"]))
        assert verdicts(rewritten, instances) == verdicts(schema, instances)
    assert "b" not in without_nothing(schema, drop_forbidden=True)["properties"]
    open_schema = {**schema, "additionalProperties": True}  # b would come back as "other"
    assert without_nothing(open_schema, drop_forbidden=True)["properties"]["b"] is False


def test_an_anyof_branch_that_matches_nothing_is_left_out():
    schema = {"anyOf": [{"enum": ["body"]}, {"not": EVERY_TYPE, "typeof": "function"}]}
    assert without_nothing(schema, drop_forbidden=True) == {"anyOf": [{"enum": ["body"]}]}
    assert validate_grammar("json_schema", json.dumps(schema), 65536, 64) == "xgrammar"


ADDRESS = {  # WashingtonPost's address trait
    "type": "object",
    "properties": {
        "street_address": {"type": "string"},
        "extended_address": {"type": "string"},
        "post_office_box": {"type": "string"},
    },
    "additionalProperties": False,
    "dependencies": {
        "extended_address": ["street_address"],
        "post_office_box": ["street_address"],
    },
}
REFERENCE = {  # and its reference, with a schema dependency
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"type": "string"},
        "website": {"type": "string"},
    },
    "required": ["id"],
    "additionalProperties": False,
    "dependencies": {"website": {"properties": {"type": {"enum": ["section"]}}}},
}


@pytest.mark.parametrize("schema", [ADDRESS, REFERENCE], ids=["keys", "schema"])
def test_dependencies_become_the_anyof_of_their_cases_exactly(schema):
    keys = [*schema["properties"], "other"]
    instances = list(objects(keys, values=("section", "x", 1)))
    for drop in (False, True):
        rewritten = without_nothing(schema, drop_forbidden=drop)
        assert "dependencies" not in json.dumps(rewritten)
        assert verdicts(rewritten, instances) == verdicts(schema, instances)
    for library in ("xgrammar", "llguidance"):
        check_library(library, "json_schema", json.dumps(schema))  # served, not refused


def test_dependencies_stay_refused_where_the_cases_would_not_be_exact():
    open_object = {**ADDRESS, "additionalProperties": True}
    required_key = {**ADDRESS, "required": ["extended_address"]}
    for schema in (open_object, required_key):
        assert without_nothing(schema, drop_forbidden=True)["dependencies"]
        with pytest.raises(ValueError, match="dependencies"):
            validate_grammar("json_schema", json.dumps(schema), 65536, 64)


def test_an_enum_beside_a_type_keeps_the_values_of_that_type():
    mixed = {"enum": ["a", 1, 2.5, None], "type": ["integer", "null"]}
    assert without_nothing(mixed, drop_forbidden=True) == {**mixed, "enum": [1, None]}
    none_left = {  # a property no value can have: forbidden, and refused where required
        "type": "object",
        "properties": {"builtin": {"enum": ["MODIFIABLE"], "type": "object"}},
        "additionalProperties": False,
    }
    assert without_nothing(none_left, drop_forbidden=True)["properties"] == {}
    instances = [{}, {"builtin": "MODIFIABLE"}, {"builtin": {}}]
    rewritten = without_nothing(none_left, drop_forbidden=False)
    assert verdicts(rewritten, instances) == verdicts(none_left, instances)
    with pytest.raises(ValueError):
        validate_grammar(
            "json_schema", json.dumps({**none_left, "required": ["builtin"]}), 65536, 64
        )


def test_a_required_key_an_open_object_does_not_list_is_listed_as_any_value():
    schema = {"required": ["batch"], "batch": {"type": "object"}}  # a misplaced schema
    rewritten = without_nothing(schema, drop_forbidden=True)
    assert rewritten["properties"] == {"batch": {}}
    instances = [{}, {"batch": 1}, {"other": 1}, {"batch": {}, "x": 2}]
    assert verdicts(rewritten, instances) == verdicts(schema, instances)
    closed = {"required": ["batch"], "additionalProperties": False}  # nothing matches
    assert "properties" not in without_nothing(closed, drop_forbidden=True)
