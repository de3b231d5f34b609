"""Per-request sampling parameters, with SGLang's native names and checks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard

SAMPLING_EPS = 1e-6
"""A temperature below this is greedy: dividing logits by it would overflow (as in SGLang)."""

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")

MAX_SEED = 2**63 - 1
"""Seeds are hashed as int64 tensors (see `engine.sampling.sampler.seeded_uniform`)."""

MAX_TEMPERATURE = 1e4
"""The sampler divides float32 logits by the temperature. Above about 6e4 the smallest step
between two bf16 logits (1/128 for |logit| >= 1) divided by it falls below float32's
resolution near 1 (1.2e-7), so every hotter temperature samples the same uniform
distribution: 1e4 is still meaningful, and any logit divided by it stays finite (a
float32 overflow to inf, as 1e39 was, turns a forbidden token's -inf / inf into NaN)."""

MIN_REPETITION_PENALTY = 1e-2
"""A seen token's positive logit is divided by the penalty. 0.01 already multiplies it by
100, which saturates softmax for any real model's logits (a repeat is then as certain as
any smaller penalty would make it), and with the smallest sampled temperature (1e-6) keeps
logits up to 3e30 finite in float32. Far smaller values (1e-40) are subnormal or zero in
float32 and make inf and NaN."""

MAX_LOGIT_BIAS = 100.0
"""OpenAI's range for `logit_bias` values is [-100, 100]: -100 already forbids a token in
practice, +100 forces it."""


@dataclass
class SamplingParams:
    """What a request asks of the sampler and of the stop checks.

    Construction only normalises representation (a single stop string becomes a list,
    JSON string keys of `logit_bias` become ints); `verify(vocab_size)` checks values,
    because the valid token-id range is only known once the model is loaded.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    """The request's draws are a function of (seed, output position) alone
    (`seeded_uniform`); `sampling_seed` (SGLang's name) is accepted for it in `from_dict`."""
    n: int = 1
    logprobs: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    """Return the logprob of every prompt token from this position on (SGLang's name; -1:
    none). Position 0 has none (nothing predicts it); the scheduler checks that it is below
    the prompt length. With `max_new_tokens` 0 a request is a prefill alone, which is what
    evaluation harnesses send to score a text (`echo` with `max_tokens` 0 or 1)."""
    prompt_top_logprobs_num: int = 0
    """How many likeliest alternatives to return at each of those prompt positions (vLLM's
    `prompt_logprobs: k`)."""
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    reasoning: bool = False
    """The output opens with a reasoning section (think … /think); a grammar constrains only
    what follows it."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}")
        self.logit_bias = {_token_id_key(k): v for k, v in self.logit_bias.items()}
        if isinstance(self.json_schema, dict):  # clients send the schema as an object or as text
            self.json_schema = json.dumps(self.json_schema)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> SamplingParams:
        """Build from a request body's `sampling_params`; a misspelt key is an error, not a
        no-op."""
        known = {f.name for f in fields(cls)}
        if "sampling_seed" in params:
            params = dict(params)
            seed = params.pop("sampling_seed")
            if params.setdefault("seed", seed) != seed:
                raise ValueError("sampling_seed and seed name one seed: give one of them")
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {unknown}; valid names are {sorted(known)}"
            )
        return cls(**params)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, source) of the one grammar constraint, if any."""
        for kind in GRAMMAR_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return kind, source
        return None

    def verify(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field; ranges follow OpenAI and SGLang, within
        what the sampler's float32 arithmetic holds (`MAX_TEMPERATURE`,
        `MIN_REPETITION_PENALTY`)."""
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=MIN_REPETITION_PENALTY, high=2.0
        )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, low=0, high=vocab_size - 1)
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, low=0, high=vocab_size - 1)
            _check_float(
                "logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS, of=f"token {token_id}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        _check_int("n", self.n, low=1)
        _check_bool("logprobs", self.logprobs)
        _check_int("top_logprobs_num", self.top_logprobs_num, low=0, high=vocab_size)
        if self.top_logprobs_num and not self.logprobs:
            raise ValueError("top_logprobs_num needs logprobs=True")
        _check_int("logprob_start_len", self.logprob_start_len, low=-1)
        _check_int("prompt_top_logprobs_num", self.prompt_top_logprobs_num, low=0, high=vocab_size)
        if self.prompt_top_logprobs_num and self.logprob_start_len < 0:
            raise ValueError("prompt_top_logprobs_num needs logprob_start_len >= 0")
        grammars = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        for kind in grammars:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(
                    f"{kind} must be a string, got {type(getattr(self, kind)).__name__}"
                )
        if len(grammars) > 1:
            raise ValueError(f"only one of json_schema, regex, ebnf may be set, got {grammars}")
        _check_bool("reasoning", self.reasoning)


def _token_id_key(key: int | str) -> int:
    """JSON object keys are strings; OpenAI's logit_bias is keyed by token id."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.lstrip("-").isdigit():
        return int(key)
    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    of: str = "",
) -> None:
    """`of` says whose value it is (a logit_bias entry's token). Integers are compared as
    they are: one too large for a float (JSON allows any) is out of range, not an
    OverflowError."""
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, {_got(value, of)}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        lower = f"> {low}" if low_open else f">= {low}"
        bounds = lower if high is None else f"{lower} and <= {high}"
        raise ValueError(f"{name} must be {bounds}, {_got(value, of)}")


def _got(value: object, of: str) -> str:
    return f"got {value!r}" + (f" for {of}" if of else "")
