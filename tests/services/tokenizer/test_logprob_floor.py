"""No NaN or Infinity in any answer: a logprob the sampler sends as -inf, NaN or float32's
minimum is shown at `LOGPROB_FLOOR` in every API shape (chat, completions, vLLM's prompt
logprobs, native `/generate`, whole and streamed), and the encoders refuse a non-finite
number that gets past it rather than writing `NaN` or `null`."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from services.io_struct import FinishReason
from services.tokenizer.choice_output import LOGPROB_FLOOR, ChoiceOutput, TokenLogprob
from services.tokenizer.protocol.chat import TopLogprob
from services.tokenizer.protocol.completions import CompletionLogprobs, VllmLogprob
from services.tokenizer.serving_chat import ChatCompletionStream, chat_completion_response
from services.tokenizer.serving_completions import CompletionStream, completion_response
from services.tokenizer.serving_generate import generate_response
from services.tokenizer.serving_openai import ResponseHeader
from services.tokenizer.sse import DeltaEvents, frame, sse_event
from tests.services.conftest import strict_json

FLOAT32_MIN = -3.4028234663852886e38
HEADER = ResponseHeader(id="x", model="m", created=0)
UNSHOWABLE = [-math.inf, math.nan, FLOAT32_MIN]
"""What the sampler may send for a token the grammar or a bias forbade."""


def token(token_id: int, logprob: float | None) -> TokenLogprob:
    """A token whose alternatives carry every unshowable value and one ordinary one."""
    tops = tuple(TokenLogprob(10 + i, f"t{i}", v) for i, v in enumerate([-0.5, *UNSHOWABLE]))
    return TokenLogprob(token_id, f"w{token_id}", logprob, tops)


CHOICE = ChoiceOutput(
    text="w1w2",
    output_ids=[1, 2],
    finish_reason=FinishReason("length"),
    prompt_tokens=2,
    completion_tokens=2,
    logprobs=(token(1, -math.inf), token(2, math.nan)),
    prompt_logprobs=(token(3, None), token(4, FLOAT32_MIN)),
)


def numbers(value: Any) -> list[float]:
    """Every float in a parsed JSON value."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return [n for item in value for n in numbers(item)]
    return []


def assert_floored(text: str) -> None:
    """`text` is strict JSON whose logprobs are -0.5 or the floor, and shows the floor."""
    values = numbers(strict_json(text))
    assert LOGPROB_FLOOR in values and set(values) <= {-0.5, LOGPROB_FLOOR}, values


def test_whole_answers_show_unshowable_logprobs_at_the_floor() -> None:
    assert_floored(json.dumps(chat_completion_response(HEADER, [CHOICE]).model_dump()))
    completion = completion_response(HEADER, [CHOICE], n=1, vllm_prompt=True)
    assert_floored(json.dumps(completion.model_dump()))
    assert_floored(json.dumps(generate_response(CHOICE), allow_nan=False))


@pytest.mark.parametrize("stream_type", [ChatCompletionStream, CompletionStream])
def test_stream_events_show_unshowable_logprobs_at_the_floor(stream_type: type) -> None:
    stream = stream_type(HEADER)
    chunks = stream.delta(0, "w1", CHOICE.logprobs[:1]) + stream.finish(
        0, CHOICE, "w2", CHOICE.logprobs[1:]
    )
    deltas = DeltaEvents(stream.text_chunk)
    events = [frame([chunk], deltas) for chunk in chunks]
    for event in events:
        strict_json(event.removeprefix("data: "))
    assert_floored("[" + ",".join(e.removeprefix("data: ") for e in events) + "]")


def test_native_stream_event_shows_unshowable_logprobs_at_the_floor() -> None:
    assert_floored(sse_event({**generate_response(CHOICE), "index": 0}).removeprefix("data: "))


def test_encoders_refuse_nan_and_infinity_instead_of_writing_them() -> None:
    with pytest.raises(ValueError):
        sse_event({"logprob": math.nan})
    for bad in (math.nan, -math.inf):
        with pytest.raises(ValidationError):
            TopLogprob(token="a", logprob=bad)
        with pytest.raises(ValidationError):
            VllmLogprob(logprob=bad, decoded_token="a")
        with pytest.raises(ValidationError):
            CompletionLogprobs(token_logprobs=[bad])
