"""Size and nesting limits, checked before anything reaches the compiler."""

import json

import pytest

from engine.grammar import GrammarError, check_grammar_limits
from engine.grammar.limits import bracket_depth, json_depth


def nested_schema(levels: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return json.dumps(schema)


def test_json_depth_counts_containers_not_scalars():
    assert json_depth(3) == 0
    assert json_depth({}) == 1
    assert json_depth({"a": [1, {"b": []}]}) == 4


def test_a_schema_within_the_depth_limit_passes_and_a_deeper_one_is_refused():
    check_grammar_limits("json_schema", nested_schema(10), max_bytes=10_000, max_depth=21)
    with pytest.raises(GrammarError, match="json_schema nests 23 levels deep; the limit is 21"):
        check_grammar_limits("json_schema", nested_schema(11), max_bytes=10_000, max_depth=21)


def test_a_schema_deeper_than_pythons_recursion_limit_is_refused_not_crashed():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(GrammarError):
        check_grammar_limits("json_schema", deep, max_bytes=10**6, max_depth=64)


def test_size_limit_is_in_utf8_bytes():
    check_grammar_limits("regex", "é" * 5, max_bytes=10, max_depth=4)
    with pytest.raises(GrammarError, match="regex is 12 bytes; the limit is 10"):
        check_grammar_limits("regex", "é" * 6, max_bytes=10, max_depth=4)


def test_invalid_json_schema_is_refused_with_the_parse_error():
    with pytest.raises(GrammarError, match="json_schema is not valid JSON"):
        check_grammar_limits("json_schema", "{bad", max_bytes=100, max_depth=4)


def test_bracket_depth_skips_escapes_character_classes_and_ebnf_strings():
    assert bracket_depth("((a)(b(c)))", quoted_strings=False) == 3
    assert bracket_depth(r"\(\(\(a", quoted_strings=False) == 0
    assert bracket_depth("[(((]x{2}", quoted_strings=False) == 1
    assert bracket_depth('root ::= "((((" (a)', quoted_strings=True) == 1
    assert bracket_depth('root ::= "((((" (a)', quoted_strings=False) == 5


def test_deep_regex_and_ebnf_are_refused():
    with pytest.raises(GrammarError, match="regex nests 5 levels deep; the limit is 4"):
        check_grammar_limits("regex", "(((((a)))))", max_bytes=100, max_depth=4)
    with pytest.raises(GrammarError, match="ebnf nests 5 levels deep"):
        check_grammar_limits("ebnf", 'root ::= ((((("a")))))', max_bytes=100, max_depth=4)
