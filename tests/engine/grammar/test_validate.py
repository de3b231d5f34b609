"""The tokenizer's check per library, and auto's choice: each library refuses what it would
not enforce, auto serves a grammar with the library that enforces it."""

import json

import pytest

from engine.grammar import GrammarError
from engine.grammar.validate import choose_backend, validate_grammar

LIMITS = (65536, 64)
ALL_OF = {
    "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "string"}}, "required": ["b"]},
    ]
}
DISJOINT_ONE_OF = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
OVERLAPPING_ONE_OF = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
NOT = {"type": "object", "not": {"required": ["a"]}}


def check(schema: dict, backend: str, best_effort: bool = False) -> str:
    return validate_grammar(
        "json_schema", json.dumps(schema), *LIMITS, best_effort=best_effort, backend=backend
    )


def test_llguidance_merges_all_of_where_xgrammar_refuses_it():
    assert check(ALL_OF, "llguidance") == "llguidance"
    with pytest.raises(GrammarError, match="'allOf' at #/allOf \\(more than one schema\\)"):
        check(ALL_OF, "xgrammar")
    assert check(ALL_OF, "auto") == "llguidance"


def test_a_one_of_is_served_as_any_of_only_where_its_branches_are_disjoint():
    for backend, library in [("xgrammar",) * 2, ("llguidance",) * 2, ("auto", "xgrammar")]:
        assert check(DISJOINT_ONE_OF, backend) == library
        with pytest.raises(GrammarError, match="'oneOf' at #/oneOf \\(branches not provably"):
            check(OVERLAPPING_ONE_OF, backend)


def test_a_keyword_no_library_enforces_is_refused_unless_best_effort():
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        check(NOT, "llguidance")
    with pytest.raises(GrammarError, match="'not' at #/not"):
        check(NOT, "xgrammar")
    with pytest.raises(GrammarError, match="Unimplemented keys"):
        check(NOT, "auto")
    assert check(NOT, "auto", best_effort=True) == "llguidance"
    assert check(OVERLAPPING_ONE_OF, "llguidance", best_effort=True) == "llguidance"


def test_auto_prefers_xgrammar_and_falls_back_to_llguidance():
    assert choose_backend("regex", "[a-z]+", *LIMITS) == "xgrammar"
    assert choose_backend("ebnf", 'root ::= Regex("[a-z]+")', *LIMITS) == "xgrammar"
    assert choose_backend("json_schema", json.dumps(ALL_OF), *LIMITS) == "llguidance"
    assert choose_backend("json_schema", json.dumps(NOT), *LIMITS) == "llguidance"  # best effort


def test_auto_sends_length_bounded_strings_to_llguidance_where_it_enforces_them():
    bounded = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 64}}}
    assert choose_backend("json_schema", json.dumps(bounded), *LIMITS) == "llguidance"
    unknown_format = {"type": "string", "maxLength": 8, "format": "year"}  # llguidance refuses it
    assert choose_backend("json_schema", json.dumps(unknown_format), *LIMITS) == "xgrammar"
    assert check({"type": "string", "format": "date"}, "auto") == "xgrammar"
