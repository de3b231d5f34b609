"""Constrained decoding end to end through the offline Engine on the embedded model, with
each grammar library."""

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from engine.api import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import FinishReason, Req
from testing.grammar_schemas import SCHEMAS

PROMPTS = {name: prompt for name, (prompt, _) in SCHEMAS.items()}
SCHEMA = {name: schema for name, (_, schema) in SCHEMAS.items()}

ARITHMETIC = """root ::= expr
expr ::= num op num | "(" num op num ")" op num
num ::= [1-9] | [1-9] [0-9]
op ::= "+" | "-" | "*"
"""
GREEDY = {"temperature": 0, "max_new_tokens": 64}


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def engine(request):
    with Engine(
        dtype="float32",
        max_total_tokens=4096,
        disable_overlap_schedule=True,
        grammar_backend=request.param,
    ) as engine:
        yield engine


def test_json_schemas_give_valid_json_that_stops(engine):
    names = list(SCHEMA)
    params = [
        {**GREEDY, "json_schema": SCHEMA[n] if i % 2 else json.dumps(SCHEMA[n])}
        for i, n in enumerate(names)
    ]
    results = engine.generate([PROMPTS[n] for n in names], params)
    for name, result in zip(names, results):
        assert result.meta.finish_reason.type == "stop", (name, result)
        jsonschema.validate(json.loads(result.text), SCHEMA[name])


def test_regex_output_fullmatches(engine):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    result = engine.generate("A US phone number:", {**GREEDY, "regex": pattern})[0]
    assert re.fullmatch(pattern, result.text)
    assert result.meta.finish_reason.type == "stop"


def test_ebnf_output_is_accepted_by_the_grammar(engine):
    result = engine.generate("Write a small sum:", {**GREEDY, "ebnf": ARITHMETIC})[0]
    assert result.meta.finish_reason.type == "stop"
    compiler = xgr.GrammarCompiler(
        xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=49152)
    )
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(ARITHMETIC))
    assert matcher.accept_string(result.text) and matcher.is_completed(), result.text
    assert isinstance(eval(result.text), int)


def test_grammar_and_plain_requests_in_one_batch_are_both_correct(engine):
    plain = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    alone = engine.generate("The three primary colors are", plain)[0]
    schema = SCHEMA["enum"]
    mixed = engine.generate(
        ["The three primary colors are", PROMPTS["enum"]],
        [plain, {**GREEDY, "json_schema": schema}],
    )
    assert mixed[0].output_ids == alone.output_ids
    jsonschema.validate(json.loads(mixed[1].text), schema)


def test_overlap_and_normal_loops_give_the_same_constrained_outputs(engine):
    names = ["nested object", "$defs and $ref", "top-level array"]
    prompts = [PROMPTS[n] for n in names] + ["Write a small sum:"]
    params = [{**GREEDY, "json_schema": SCHEMA[n]} for n in names] + [
        {**GREEDY, "ebnf": ARITHMETIC}
    ]
    normal = engine.generate(prompts, params)
    with Engine(
        dtype="float32",
        max_total_tokens=4096,
        disable_overlap_schedule=False,
        grammar_backend=engine.args.grammar_backend,
    ) as overlap_engine:
        assert overlap_engine.scheduler.overlap
        overlapped = overlap_engine.generate(prompts, params)
    assert [r.output_ids for r in overlapped] == [r.output_ids for r in normal]
    assert all(r.meta.finish_reason.type == "stop" for r in overlapped)


def test_bad_grammars_fail_alone_with_400_while_a_plain_request_finishes(engine):
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    results = engine.generate(
        ["a", "b", "c", "d"],
        [
            {"json_schema": "{bad"},
            {"regex": "(abc"},
            {"json_schema": deep},
            {"max_new_tokens": 4, "ignore_eos": True},
        ],
    )
    regex_error = {"xgrammar": "Regex parsing error", "llguidance": "unclosed group"}
    messages = [
        "json_schema is not valid JSON",
        regex_error[engine.args.grammar_backend],
        "json_schema nests 81 levels deep",
    ]
    assert results[1].meta.finish_reason.message.startswith("invalid regex: ")
    for result, message in zip(results, messages):
        reason = result.meta.finish_reason
        assert reason.type == "abort" and reason.status_code == 400 and message in reason.message
        assert result.output_ids == []
    assert results[3].meta.finish_reason == FinishReason("length")
    assert engine.scheduler.grammar_queue.reqs == []


def test_a_grammar_request_waits_in_the_grammar_queue_until_compiled(engine):
    req = Req(
        "queued",
        engine.tokenizer.encode("Pick:"),
        SamplingParams(temperature=0, max_new_tokens=8, regex="a|b"),
    )
    engine.scheduler.add_request(req)
    assert (
        engine.scheduler.grammar_queue.reqs == [req] and req not in engine.scheduler.prefill.waiting
    )
    engine.scheduler.run_event_loop(lambda: req.finished)
    assert engine.tokenizer.decode(req.output_ids, skip_special_tokens=True) in ("a", "b")
    assert req.lifecycle.finished_reason.type == "stop" and not engine.scheduler.has_work()


def test_grammars_need_a_tokenizer(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.generate([5, 6, 7], {"regex": "a"})


def test_a_grammar_the_tokenizer_cannot_spell_is_a_400_not_a_server_error(engine):
    # U+98904 (UTF-8 F2 98 A4 84) has no spelling in SmolLM2's vocabulary: the mask empties.
    result = engine.generate("Hi", {"regex": "\U00098904", "max_new_tokens": 8})[0]
    reason = result.meta.finish_reason
    assert (reason.type, reason.status_code) == ("abort", 400)
    assert "regex" in reason.message
    assert not engine.scheduler.has_work()


def test_min_new_tokens_yields_to_a_grammar_that_has_ended(engine):
    params = {"temperature": 0, "regex": "a", "min_new_tokens": 5, "max_new_tokens": 8}
    result = engine.generate("Say a", params)[0]
    assert result.text == "a" and result.meta.finish_reason.type == "stop"
