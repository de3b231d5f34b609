"""SamplingParams: SGLang's defaults, normalisation, and a clear error for every bad value."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from engine.sampling.sampling_params import (
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)

VOCAB = 100


def test_defaults_follow_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.n, p.seed, p.ignore_eos, p.skip_special_tokens, p.grammar) == (
        1,
        None,
        False,
        True,
        None,
    )
    p.verify(VOCAB)


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_from_dict_normalises_a_json_request_body() -> None:
    p = SamplingParams.from_dict(
        {"stop": "###", "logit_bias": {"5": -100.0, "7": 2.5}, "temperature": 0}
    )
    assert p.stop == ["###"]
    assert p.logit_bias == {5: -100.0, 7: 2.5}
    p.verify(VOCAB)


def test_from_dict_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"unknown sampling parameter\(s\) \['max_tokens', 'topp'\]"
    ):
        SamplingParams.from_dict({"max_tokens": 5, "topp": 0.9, "temperature": 0.5})


def test_logit_bias_that_is_not_keyed_by_token_ids_is_rejected() -> None:
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"hello": 1.0})
    with pytest.raises(ValueError, match="logit_bias must map token ids to biases"):
        SamplingParams.from_dict({"logit_bias": [[5, 1.0]]})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", 1.5),
        ("min_new_tokens", -1),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 2.01),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [VOCAB]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("logit_bias", {VOCAB: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: math.inf}),
        ("logit_bias", {3: math.nan}),
        ("logit_bias", {3: -math.inf}),
        ("logit_bias", {3: 100.01}),
        ("logit_bias", {3: 1e39}),
        ("logit_bias", {3: 10**400}),
        ("temperature", MAX_TEMPERATURE * 1.01),
        ("temperature", 1e39),
        ("temperature", 10**400),
        ("top_p", 10**400),
        ("repetition_penalty", 1e-40),
        ("repetition_penalty", MIN_REPETITION_PENALTY * 0.99),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", "42"),
        ("n", 0),
        ("logprobs", "true"),
        ("top_logprobs_num", -1),
        ("top_logprobs_num", VOCAB + 1),
        ("json_schema", ["not", "a", "schema"]),
    ],
)
def test_verify_rejects_bad_value_naming_the_field(field: str, value: Any) -> None:
    params = SamplingParams(**{"logprobs": True, field: value})
    with pytest.raises(ValueError, match=field):
        params.verify(VOCAB)


@pytest.mark.parametrize(
    "overrides",
    [
        {"temperature": 0.0, "top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"frequency_penalty": -2.0, "presence_penalty": 2.0, "repetition_penalty": 2.0},
        {"temperature": MAX_TEMPERATURE, "repetition_penalty": MIN_REPETITION_PENALTY},
        {"temperature": -0.0, "top_p": 5e-324, "min_p": 5e-324, "presence_penalty": -0.0},
        {"logit_bias": {0: -100, VOCAB - 1: 100.0}, "stop_token_ids": [0, VOCAB - 1]},
        {"seed": 0, "top_logprobs_num": VOCAB, "logprobs": True, "max_new_tokens": 0},
        {"top_k": VOCAB * 10},
    ],
)
def test_verify_accepts_boundary_values(overrides: dict[str, Any]) -> None:
    SamplingParams(**overrides).verify(VOCAB)


def test_min_new_tokens_above_max_new_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_new_tokens must be <= max_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5).verify(VOCAB)


def test_top_logprobs_num_without_logprobs_is_rejected() -> None:
    with pytest.raises(ValueError, match="top_logprobs_num needs logprobs"):
        SamplingParams(top_logprobs_num=5).verify(VOCAB)


def test_more_than_one_grammar_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"only one of json_schema, regex, ebnf.*\['json_schema', 'regex'\]"
    ):
        SamplingParams(json_schema='{"type": "string"}', regex="[a-z]+").verify(VOCAB)
    assert SamplingParams(regex="[a-z]+").grammar == ("regex", "[a-z]+")


def test_a_json_schema_object_is_kept_as_json_text():
    params = SamplingParams.from_dict(
        {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    )
    assert json.loads(params.json_schema) == {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
    }
    assert params.grammar == ("json_schema", params.json_schema)
