"""Jump-forward decoding: the token-boundary plan on the real tokenizer, and the Engine with
jump-forward on (overlap loop and radix cache on) against the normal loop without it."""

import json
import re

import jsonschema
import pytest

from engine.api import Engine
from engine.detokenize import IncrementalDetokenizer
from engine.grammar.jump_forward import JumpForward, decodes_concatenatively, plan_jump_forward
from engine.model.tokenizer_cache import load_tokenizer
from testing.grammar_schemas import SCHEMAS

GREEDY = {"temperature": 0, "max_new_tokens": 96}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded")


@pytest.fixture(scope="module")
def engines():
    with (
        Engine(dtype="float32", max_total_tokens=8192, disable_overlap_schedule=True) as plain,
        Engine(
            dtype="float32",
            max_total_tokens=8192,
            disable_overlap_schedule=False,
            enable_jump_forward=True,
        ) as jf,
    ):
        assert jf.scheduler.overlap and jf.scheduler.output_processor.jump_forward
        yield plain, jf


def test_the_forced_text_merges_with_the_sampled_brace_into_the_tokenizers_own_tokens(tokenizer):
    output = tokenizer.encode("{", add_special_tokens=False)
    plan = plan_jump_forward(tokenizer, output, '"name": "')
    assert plan.rollback == 1  # "{" + '"' is one token, '{"'
    assert plan.token_ids == tokenizer.encode('{"name": "', add_special_tokens=False)


def test_forced_text_after_a_clean_boundary_appends_without_rollback(tokenizer):
    output = tokenizer.encode("[1, 2", add_special_tokens=False)
    plan = plan_jump_forward(tokenizer, output, "]")
    assert plan == JumpForward(0, tokenizer.encode("]", add_special_tokens=False))


def test_no_plan_when_the_tail_splits_a_character(tokenizer):
    ids = tokenizer.encode("日本語", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))
    assert plan_jump_forward(tokenizer, ids[:split], '"') is None


def test_sentencepiece_style_decoding_is_detected_as_not_concatenative(tokenizer):
    class LeadingSpaceDropping:  # SentencePiece drops a piece's leading space when decoded alone
        def encode(self, text, add_special_tokens=False):
            return tokenizer.encode(text, add_special_tokens=False)

        def decode(self, ids, skip_special_tokens=False):
            return tokenizer.decode(ids).lstrip(" ")

    assert decodes_concatenatively(tokenizer)
    assert not decodes_concatenatively(LeadingSpaceDropping())


def test_detokenizer_rollback_keeps_the_emitted_text_a_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    old = tokenizer.encode("{", add_special_tokens=False)
    text = detok.add_tokens(old)
    detok.rollback(1)
    text += detok.add_tokens(tokenizer.encode('{"a": 1}', add_special_tokens=False), finished=True)
    assert text == '{"a": 1}' == detok.final_text()


def test_jump_forward_needs_the_radix_cache():
    with pytest.raises(ValueError, match="needs the radix cache"):
        Engine(
            dtype="float32",
            max_total_tokens=1024,
            disable_radix_cache=True,
            enable_jump_forward=True,
        )


def test_jump_forward_gives_valid_outputs_with_fewer_forward_passes(engines):
    """One request at a time, so that forward passes count per request: each forced token
    is a decode pass saved, and the two runs differ by exactly that many passes less the
    extends that brought jumped requests back (one per jump)."""
    plain, jf = engines
    names = list(SCHEMAS)[::2]  # ten of the twenty: every kind of construct, half the time
    passes = {}
    results = {}
    for engine in (plain, jf):
        stats = engine.scheduler.stats
        before = sum(stats.forward_modes.values())
        results[engine] = [
            engine.generate(SCHEMAS[n][0], {**GREEDY, "json_schema": SCHEMAS[n][1]})[0]
            for n in names
        ]
        passes[engine] = sum(stats.forward_modes.values()) - before
    for name, result in zip(names, results[jf]):
        assert result.meta.finish_reason.type == "stop", (name, result)
        jsonschema.validate(json.loads(result.text), SCHEMAS[name][1])
    stats = jf.scheduler.stats
    assert stats.jump_forwards > len(names) and stats.jump_forward_tokens > stats.jump_forwards
    assert passes[jf] < passes[plain] / 2
    # Where jump-forward's canonical tokens lead the model to the same choices, outputs are
    # identical; a forced token can also remove a merged token that carried a choice (`",`
    # = close the string and continue the list), so a few outputs may differ.
    same = [
        name
        for name, a, b in zip(names, results[plain], results[jf])
        if json.loads(a.text) == json.loads(b.text)
    ]
    assert len(same) >= 0.75 * len(names), same


@pytest.mark.parametrize(
    ("prompt", "grammar"),
    [
        ("A US phone number:", {"regex": PHONE}),
        (SCHEMAS["nested object"][0], {"json_schema": SCHEMAS["nested object"][1]}),
    ],
    ids=["regex", "json schema"],
)
def test_a_stream_with_rollbacks_rebuilds_the_final_text_and_ids(
    engines, tokenizer, prompt, grammar
):
    """The first sampled token ("{") is rolled back in the very step that first reports it:
    a reader never drops more ids than it was given."""
    _, jf = engines
    expected = jf.generate(prompt, {**GREEDY, **grammar})[0]
    chunks = list(jf.generate_stream(prompt, {**GREEDY, **grammar}))
    text = "".join(c.text for c in chunks)
    ids: list[int] = []
    for chunk in chunks:
        assert chunk.rollback <= len(ids)
        del ids[len(ids) - chunk.rollback :]
        ids += chunk.output_ids
    assert text == expected.text and ids == expected.output_ids
    assert chunks[-1].meta.finish_reason.type == "stop"
    if "regex" in grammar:
        assert re.fullmatch(PHONE, text)
    else:
        jsonschema.validate(json.loads(text), grammar["json_schema"])
