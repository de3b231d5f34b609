"""A grammar after a reasoning section: everything is allowed until the think-end token,
the grammar after it; rollback crosses the boundary; only the grammar terminates."""

import json
import time

import pytest
import torch

from engine.grammar import GrammarBackend, ReasoningGrammarMatcher, allocate_vocab_mask
from engine.model.tokenizer_cache import load_tokenizer

EOS = 2
VOCAB = 49152 + 2  # SmolLM2's, with <think> and </think>
SCHEMA = json.dumps(
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
)
ANSWER = '{"answer": "yes"}'


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer with `<think>` and `</think>` added as ordinary tokens, as Qwen3
    and DeepSeek-R1 have them."""
    tokenizer = load_tokenizer("embedded")
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    return tokenizer


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    assert len(tokenizer) == VOCAB
    backend = GrammarBackend(
        tokenizer, VOCAB, backend=request.param, stop_token_ids=[EOS], think_end_token="</think>"
    )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def grammar(backend):
    pending = backend.submit("json_schema", SCHEMA)
    while pending.result() is None:
        time.sleep(0.005)
    return pending


@pytest.fixture
def matcher(backend, grammar):
    matcher = backend.new_matcher(grammar, reasoning=True)
    assert isinstance(matcher, ReasoningGrammarMatcher)
    return matcher


def mask_of(matcher) -> torch.Tensor:
    """The matcher's mask row, written over a row of zeros (so nothing is left to chance)."""
    mask = torch.zeros_like(allocate_vocab_mask(1, VOCAB))
    matcher.fill_vocab_mask(mask, 0)
    return mask[0]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_think_end_token_is_resolved_from_the_vocabulary(backend, tokenizer):
    assert backend.think_end_token_id == tokenizer.convert_tokens_to_ids("</think>")
    with pytest.raises(ValueError, match=r"'</think>' is not one token of the vocabulary"):
        GrammarBackend(load_tokenizer("embedded"), 49152, think_end_token="</think>")


def test_reasoning_applies_only_when_asked_and_the_backend_has_a_think_end_token(
    backend, grammar, tokenizer
):
    assert not isinstance(backend.new_matcher(grammar, reasoning=False), ReasoningGrammarMatcher)
    plain = GrammarBackend(tokenizer, VOCAB, backend=backend.name, stop_token_ids=[EOS])
    try:
        assert not isinstance(plain.new_matcher(grammar, reasoning=True), ReasoningGrammarMatcher)
    finally:
        plain.shutdown()


def test_everything_is_allowed_and_nothing_forced_until_the_think_end_token(
    backend, matcher, tokenizer, grammar
):
    constrained = backend.new_matcher(grammar, reasoning=False)
    assert constrained.find_jump_forward_string()  # the schema forces its opening text
    for token in ids(tokenizer, "<think>Let me see: {} ] yes") + [EOS]:
        assert (mask_of(matcher) == -1).all()
        assert matcher.find_jump_forward_string() == ""
        assert matcher.allows_any_token()
        assert matcher.accept_token(token)
        assert not matcher.is_terminated()
    assert matcher.accept_token(matcher.think_end_token_id)
    assert torch.equal(mask_of(matcher), mask_of(constrained))
    assert matcher.find_jump_forward_string() == constrained.find_jump_forward_string()
    assert not matcher.accept_token(ids(tokenizer, "no")[0])  # refused, state unchanged
    assert torch.equal(mask_of(matcher), mask_of(constrained))


def test_the_grammar_terminates_the_answer_and_only_the_answer(matcher, tokenizer):
    for token in ids(tokenizer, ANSWER):  # the answer written while reasoning is not one
        assert matcher.accept_token(token)
    assert matcher.accept_token(EOS) and not matcher.is_terminated()
    assert matcher.accept_token(matcher.think_end_token_id)
    for token in ids(tokenizer, ANSWER):
        assert not matcher.is_terminated()
        assert matcher.accept_token(token)
    assert not matcher.is_terminated()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()


def test_rollback_across_the_boundary_reopens_the_reasoning_section(matcher, tokenizer):
    reasoning = ids(tokenizer, "<think>hm")
    answer = ids(tokenizer, '{"answer": "')
    for token in [*reasoning, matcher.think_end_token_id, *answer]:
        assert matcher.accept_token(token)
    after_answer = mask_of(matcher)

    matcher.rollback(1)  # within the answer: still constrained
    assert not (mask_of(matcher) == -1).all()
    assert matcher.accept_token(answer[-1])
    assert torch.equal(mask_of(matcher), after_answer)

    matcher.rollback(len(answer) + 2)  # the answer, the think-end token and one more
    assert (mask_of(matcher) == -1).all()
    assert matcher.find_jump_forward_string() == ""
    assert matcher.accept_token(ids(tokenizer, "{")[0])  # free again: JSON the grammar refuses
    matcher.rollback(1)
    for token in [reasoning[-1], matcher.think_end_token_id, *answer]:
        assert matcher.accept_token(token)
    assert torch.equal(mask_of(matcher), after_answer)

    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(reasoning) + 1 + len(answer) + 1)


def test_a_jump_forward_right_after_the_think_end_token_is_the_grammars(matcher, tokenizer):
    """The scheduler re-encodes the tail with the forced text, rolls back and accepts the
    new tokens: here the rollback reaches behind the think-end token."""
    assert matcher.accept_token(ids(tokenizer, "ok")[0])
    assert matcher.accept_token(matcher.think_end_token_id)
    forced = matcher.find_jump_forward_string()
    assert forced and ANSWER.startswith(forced)
    matcher.rollback(2)
    for token in ids(tokenizer, "ok</think>" + forced):
        assert matcher.accept_token(token)
    assert matcher.find_jump_forward_string() == ""  # the enum is a real choice
