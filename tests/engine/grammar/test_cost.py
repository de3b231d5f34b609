"""Mask cost judged before a grammar runs (nested variable counted repeats), where auto
sends such a grammar, and llguidance's per-token budget ending a request at run time."""

import time

import pytest

from engine.grammar import GrammarBackend, GrammarError, allocate_vocab_mask
from engine.grammar.cost import GrammarCostError, explosive, nested_repeats
from engine.grammar.validate import validate_grammar
from engine.model.tokenizer_cache import load_tokenizer

ISSUE_REGEX = "((((a{0,128}){0,128}){0,128}){0,128})"


@pytest.mark.parametrize(
    ("kind", "source", "depth", "product"),
    [
        ("regex", ISSUE_REGEX, 4, 128**4),
        ("regex", "(((a{0,8}){0,8}){0,8})b", 3, 512),
        ("regex", "((a{0,1000}){0,1000})", 2, 10**6),
        ("regex", r"((\d{1,3}\.){3}\d{1,3},){0,5}", 2, 15),  # {3} is fixed: no level
        ("regex", "((a*)*)*b", 0, 1),  # unbounded repeats do not count
        ("regex", r"[{(]{0,9}\((a{0,9})", 1, 9),  # brackets in a class or escaped are literal
        ("ebnf", 'root ::= (("a"{0,64}){0,64}){0,64} "b"', 3, 64**3),
        ("ebnf", 'root ::= "((({0,9}" [a]{0,4}', 1, 4),  # inside a string: literal
        ("json_schema", '{"type": "string"}', 0, 1),
    ],
)
def test_nested_repeats_finds_the_deepest_nest_of_variable_counts(kind, source, depth, product):
    nest = nested_repeats(kind, source)
    assert (nest.depth, nest.product) == (depth, product)


def test_three_levels_over_a_product_of_64_are_explosive():
    assert explosive(nested_repeats("regex", "(((a{0,8}){0,8}){0,8})"))
    assert not explosive(nested_repeats("regex", "(((a{0,4}){0,4}){0,4})"))  # 64: served
    assert not explosive(nested_repeats("regex", "((a{0,1000}){0,1000})"))  # two levels


def test_auto_sends_an_explosive_regex_to_llguidance_and_xgrammar_refuses_it():
    assert validate_grammar("regex", ISSUE_REGEX, 65536, 64) == "llguidance"
    assert validate_grammar("regex", "((a{0,128}){0,128})", 65536, 64) == "xgrammar"
    with pytest.raises(GrammarError, match=r"nests 4 variable counted repeats .*\{0,128\}"):
        validate_grammar("regex", ISSUE_REGEX, 65536, 64, backend="xgrammar")
    assert validate_grammar("regex", ISSUE_REGEX, 65536, 64, backend="llguidance") == "llguidance"


def test_llguidance_ends_the_issues_regex_with_a_cost_error_within_a_bounded_time():
    tokenizer = load_tokenizer("embedded")
    backend = GrammarBackend(tokenizer, 49152, backend="llguidance", stop_token_ids=[2])
    try:
        pending = backend.submit("regex", ISSUE_REGEX)
        while pending.result() is None:
            time.sleep(0.005)
        matcher = backend.new_matcher(pending, reasoning=False)
        mask = allocate_vocab_mask(1, 49152)
        (aaaa,) = tokenizer.encode("aaaa", add_special_tokens=False)
        started = time.monotonic()
        with pytest.raises(GrammarCostError, match="too costly"):
            for _ in range(64):  # xgrammar took 18 s for the fifth mask of this regex
                matcher.fill_vocab_mask(mask, 0)
                assert matcher.accept_token(aaaa)
        assert time.monotonic() - started < 5
    finally:
        backend.shutdown()
