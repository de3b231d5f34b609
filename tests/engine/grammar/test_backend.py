"""The grammar backend over each library: compile off the caller's thread, cache, clear
errors, matchers; auto's choice of library per grammar."""

import time

import pytest
import torch

from engine.grammar import GrammarBackend, GrammarError, PendingGrammar, allocate_vocab_mask
from engine.grammar.backend import GRACE_S, CompileJob
from engine.model.tokenizer_cache import load_tokenizer
from engine.sampling.vocab_mask import apply_vocab_mask

VOCAB = 49152  # SmolLM2's; the embedded tokenizer has exactly this many tokens
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


def make_backend(tokenizer, library: str) -> GrammarBackend:
    return GrammarBackend(
        tokenizer, VOCAB, backend=library, stop_token_ids=[EOS], max_nesting_depth=8
    )


@pytest.fixture(scope="module", params=["xgrammar", "llguidance", "auto"])
def backend(request, tokenizer):
    backend = make_backend(tokenizer, request.param)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def xgrammar(tokenizer):
    backend = make_backend(tokenizer, "xgrammar")
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def llguidance(tokenizer):
    backend = make_backend(tokenizer, "llguidance")
    yield backend
    backend.shutdown()


def compiled(pending: PendingGrammar) -> PendingGrammar:
    while pending.result() is None:
        time.sleep(0.005)
    return pending


def test_the_same_grammar_text_shares_one_cached_compile(backend):
    first = backend.submit("regex", "[ab]{2}")
    assert backend.submit("regex", "[ab]{2}").future is first.future
    assert backend.submit("ebnf", "[ab]{2}").future is not first.future  # keyed by kind too


def test_compile_errors_read_without_xgrammars_log_prefix(xgrammar):
    backend = xgrammar
    with pytest.raises(GrammarError) as e:
        compiled(backend.submit("regex", "(abc"))
    assert (
        str(e.value)
        == "invalid regex: Regex parsing error at position 5: The parenthesis is not closed."
    )
    with pytest.raises(GrammarError, match=r'^invalid json_schema: Unsupported type "foo"'):
        compiled(backend.submit("json_schema", '{"type": "foo"}'))


def test_a_grammar_over_the_limits_fails_without_compiling(backend):
    pending = backend.submit("regex", "(" * 9 + ")" * 9)
    assert pending.future.done()
    with pytest.raises(GrammarError, match="regex nests 9 levels deep; the limit is 8"):
        pending.result()


def test_a_compile_past_its_budget_fails_the_wait_and_a_queued_one_waits_on():
    queued = PendingGrammar("ebnf", CompileJob(), timeout_s=0)
    time.sleep(GRACE_S)
    assert queued.result() is None  # not started: waiting for a compile worker
    started = CompileJob()
    started.mark_started()
    running = PendingGrammar("ebnf", started, timeout_s=0)
    assert running.result() is None  # the grace for a compile stopped at its budget
    time.sleep(GRACE_S)
    with pytest.raises(GrammarError, match="compiling the ebnf took longer than 0 s"):
        running.result()


def test_llguidance_compile_errors_name_the_grammar_and_the_fault(llguidance):
    with pytest.raises(GrammarError, match=r"(?s)^invalid regex: .*unclosed group"):
        compiled(llguidance.submit("regex", "(abc"))
    with pytest.raises(GrammarError, match=r"^invalid ebnf: "):
        compiled(llguidance.submit("ebnf", 'root ::= "a'))


def test_matcher_masks_accepts_and_terminates_on_the_stop_token(backend, tokenizer):
    matcher = backend.new_matcher(compiled(backend.submit("regex", "yes|no")), reasoning=False)
    vocab_mask = allocate_vocab_mask(2, VOCAB)
    matcher.fill_vocab_mask(vocab_mask, 1)
    logits = torch.zeros(2, VOCAB)
    apply_vocab_mask(logits, vocab_mask)
    assert torch.isfinite(logits[0]).all()  # a row the matcher did not fill stays all-allowed
    allowed = {
        tokenizer.decode([t]) for t in torch.isfinite(logits[1]).nonzero().flatten().tolist()
    }
    assert allowed and all("yes".startswith(s) or "no".startswith(s) for s in allowed)
    assert not matcher.accept_token(tokenizer.encode("maybe")[0])
    for token in tokenizer.encode("yes"):
        assert matcher.accept_token(token)
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_a_matcher_ended_by_its_stop_token_rolls_back_to_before_it(backend, tokenizer):
    """llguidance stops by itself after "yes" (nothing can follow) and refuses the stop
    token; the matcher takes it, and a rollback undoes it as for xgrammar."""
    matcher = backend.new_matcher(compiled(backend.submit("regex", "yes|no")), reasoning=False)
    for token in tokenizer.encode("yes"):
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert not matcher.accept_token(EOS)
    matcher.rollback(1)
    assert not matcher.is_terminated()
    matcher.rollback(len(tokenizer.encode("yes")))
    assert matcher.find_jump_forward_string() == ""  # "yes" or "no": a choice
    assert matcher.accept_token(tokenizer.encode("no")[0])


def test_jump_forward_strings_are_the_text_the_grammar_forces(backend):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    matcher = backend.new_matcher(compiled(backend.submit("json_schema", schema)), False)
    assert matcher.find_jump_forward_string() == '{"a": '


def test_auto_serves_each_grammar_with_a_library_that_enforces_it(tokenizer):
    """xgrammar where it enforces the grammar; a schema only llguidance enforces (an
    `allOf` of two schemas) goes to llguidance."""
    backend = make_backend(tokenizer, "auto")
    all_of = '{"allOf": [{"required": ["a"]}, {"required": ["b"]}], "type": "object"}'
    try:
        assert compiled(backend.submit("regex", "a+")).backend == "xgrammar"
        assert compiled(backend.submit("json_schema", all_of)).backend == "llguidance"
    finally:
        backend.shutdown()
