"""Results out: usage counting, response objects, the chunk sequence of a stream as SSE
events, and the native /generate answer. (`[DONE]` is the edge's: test_serving_base.)"""

from __future__ import annotations

import json

import pytest

from engine.outputs import GenerateMeta, GenerateResult
from engine.sched.req import FinishReason as EngineFinishReason
from services.io_struct import FinishReason
from services.tokenizer.choice_output import ChoiceOutput, TokenLogprob
from services.tokenizer.errors import RequestError
from services.tokenizer.protocol.chat import ChatCompletionChunk
from services.tokenizer.protocol.completions import CompletionChunk
from services.tokenizer.routes import model_list
from services.tokenizer.serving_chat import ChatCompletionStream, chat_completion_response
from services.tokenizer.serving_completions import CompletionStream, completion_response
from services.tokenizer.serving_generate import generate_progress, generate_response
from services.tokenizer.serving_openai import ChunkStream, ResponseHeader, usage_info
from services.tokenizer.sse import SSE_DONE, Chunk, DeltaEvents, frame, sse_event

HEADER = ResponseHeader(id="chatcmpl-1", model="smollm2", created=1_700_000_000)
STOP, LENGTH = FinishReason("stop", matched=2), FinishReason("length")


def choice(
    text: str = "hi",
    reason: FinishReason = STOP,
    prompt: int = 10,
    completion: int = 2,
    cached: int = 0,
    logprobs: tuple[TokenLogprob, ...] | None = None,
) -> ChoiceOutput:
    return ChoiceOutput(text, list(range(completion)), reason, prompt, completion, cached, logprobs)


def framed(stream: ChunkStream, chunks: list[Chunk]) -> list[str]:
    """Each chunk as the edge frames it, one event each."""
    deltas = DeltaEvents(stream.text_chunk)
    return [frame([chunk], deltas) for chunk in chunks]


def from_engine_result(result: GenerateResult) -> ChoiceOutput:
    """A finished result of the offline Engine as the tokenizer service's choice."""
    meta, reason = result.meta, result.meta.finish_reason
    if reason is None:
        raise ValueError("an unfinished engine result has no choice")
    return ChoiceOutput(
        text=result.text,
        output_ids=list(result.output_ids),
        finish_reason=FinishReason(reason.type, reason.matched, reason.message, reason.status_code),
        prompt_tokens=meta.prompt_tokens,
        completion_tokens=meta.completion_tokens,
        cached_tokens=meta.cached_tokens,
    )


def parse(events: list[str]) -> list[dict]:
    """SSE events back into JSON objects."""
    out = []
    for event in events:
        assert event.startswith("data: ") and event.endswith("\n\n")
        out.append(json.loads(event[len("data: ") : -2]))
    return out


def test_usage_counts_each_prompt_once_across_n_samples():
    # Two prompts, n=2: the second copy of each prompt hit the first one's prefill.
    choices = [
        choice(prompt=10, completion=3, cached=4),
        choice(prompt=10, completion=5, cached=10),
        choice(prompt=7, completion=1, cached=0),
        choice(prompt=7, completion=2, cached=7),
    ]
    usage = usage_info(choices, n=2)
    assert usage.model_dump() == {
        "prompt_tokens": 17,
        "completion_tokens": 11,
        "total_tokens": 28,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_chat_response_with_n_2_has_one_choice_each_and_summed_usage():
    choices = [choice("a", STOP, cached=6), choice("bb", LENGTH, completion=4, cached=10)]
    response = chat_completion_response(HEADER, choices)
    body = response.model_dump()
    assert (
        body["object"] == "chat.completion"
        and body["id"] == "chatcmpl-1"
        and body["model"] == "smollm2"
    )
    assert [(c["index"], c["message"], c["finish_reason"]) for c in body["choices"]] == [
        (0, {"role": "assistant", "content": "a"}, "stop"),
        (1, {"role": "assistant", "content": "bb"}, "length"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 6,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 6},
    }


def test_logprobs_take_the_chat_and_the_completions_shapes():
    lps = (
        TokenLogprob(5, "Hé", -0.1, (TokenLogprob(5, "Hé", -0.1), TokenLogprob(6, "Ho", -2.5))),
        TokenLogprob(7, "!", -0.7),
    )
    chat = (
        chat_completion_response(HEADER, [choice("Hé!", logprobs=lps)])
        .choices[0]
        .logprobs.model_dump()
    )
    assert chat["content"][0] == {
        "token": "Hé",
        "logprob": -0.1,
        "bytes": list("Hé".encode()),
        "top_logprobs": [
            {"token": "Hé", "logprob": -0.1, "bytes": list("Hé".encode())},
            {"token": "Ho", "logprob": -2.5, "bytes": [72, 111]},
        ],
    }
    completion = (
        completion_response(HEADER, [choice("Hé!", logprobs=lps)], n=1)
        .choices[0]
        .logprobs.model_dump()
    )
    assert completion == {
        "text_offset": [0, 2],
        "token_logprobs": [-0.1, -0.7],
        "tokens": ["Hé", "!"],
        "top_logprobs": [{"Hé": -0.1, "Ho": -2.5}, {}],
    }


def test_an_aborted_choice_is_an_error_not_a_truncated_answer():
    aborted = choice(reason=FinishReason("abort", message="out of KV memory"))
    with pytest.raises(RequestError) as raised:
        completion_response(HEADER, [choice(), aborted], n=1)
    assert (raised.value.message, raised.value.status) == ("out of KV memory", 500)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_opens_with_the_role_then_deltas_then_finish_then_usage_then_done(
    include_usage,
):
    stream = ChatCompletionStream(HEADER, n=1, include_usage=include_usage)
    events = [*stream.delta(0, "Hel"), *stream.delta(0, ""), *stream.delta(0, "lo")]
    events += stream.finish(0, choice("Hello", STOP, prompt=9, completion=3, cached=8), text="!")
    events += stream.end()
    chunks = parse(framed(stream, events))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == HEADER.id
    deltas = [
        (c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks if c["choices"]
    ]
    assert deltas == [
        ({"role": "assistant", "content": ""}, None),
        ({"content": "Hel"}, None),
        ({"content": "lo"}, None),
        ({"content": "!"}, None),
        ({}, "stop"),
    ]
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    if include_usage:
        assert usage_chunks == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == {
            "prompt_tokens": 9,
            "completion_tokens": 3,
            "total_tokens": 12,
            "prompt_tokens_details": {"cached_tokens": 8},
        }
    else:
        assert usage_chunks == []


def test_chat_stream_with_n_2_opens_each_choice_once():
    stream = ChatCompletionStream(HEADER, n=2, include_usage=True)
    events = [*stream.delta(1, "b"), *stream.delta(0, "a"), *stream.delta(1, "b")]
    events += stream.finish(0, choice("a", completion=1)) + stream.finish(
        1, choice("bb", LENGTH, completion=2)
    )
    chunks = parse(framed(stream, events + stream.end()))
    roles = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["delta"].get("role")]
    assert roles == [1, 0]
    assert (
        chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["usage"]["prompt_tokens"] == 10
    )


def test_completion_stream_has_no_role_chunk_and_continues_logprob_offsets():
    stream = CompletionStream(HEADER, n=1, include_usage=False)
    events = stream.delta(0, "ab", [TokenLogprob(1, "ab", -1.0)])
    events += stream.finish(0, choice("abc"), text="c", logprobs=[TokenLogprob(2, "c", -2.0)])
    chunks = parse(framed(stream, events + stream.end()))
    for chunk in chunks:
        CompletionChunk.model_validate(chunk)
        assert chunk["object"] == "text_completion"
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        ("ab", None),
        ("c", None),
        ("", "stop"),
    ]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [2]


def test_a_stream_that_fails_ends_with_an_error_event():
    stream = ChatCompletionStream(HEADER)
    with pytest.raises(RequestError) as raised:
        stream.finish(0, choice(reason=FinishReason("abort", message="worker died")))
    chunks = parse(framed(stream, stream.error(raised.value)))
    assert chunks == [
        {
            "error": {
                "message": "worker died",
                "type": "server_error",
                "param": None,
                "code": "request_aborted",
            }
        },
    ]


def test_sse_event_frames_models_and_dicts():
    assert sse_event({"a": "é"}) == 'data: {"a": "é"}\n\n'
    assert sse_event(model_list("smollm2", 2048, created=1)) == (
        'data: {"object":"list","data":[{"id":"smollm2","object":"model","created":1,'
        '"owned_by":"radixserve","max_model_len":2048}]}\n\n'
    )
    assert SSE_DONE == "data: [DONE]\n\n"


def test_generate_response_is_sglangs_native_shape():
    result = GenerateResult(
        text="Hi!",
        output_ids=[3, 4, 2],
        meta=GenerateMeta(
            prompt_tokens=5,
            completion_tokens=3,
            cached_tokens=4,
            finish_reason=EngineFinishReason("stop", matched=2),
        ),
    )
    assert generate_response(from_engine_result(result)) == {
        "text": "Hi!",
        "output_ids": [3, 4, 2],
        "meta_info": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "cached_tokens": 4,
            "finish_reason": {"type": "stop", "matched": 2},
        },
    }
    with_logprobs = choice(logprobs=(TokenLogprob(3, "Hi", -0.5, (TokenLogprob(3, "Hi", -0.5),)),))
    meta = generate_response(with_logprobs)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 3, "Hi"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 3, "Hi"]]]


def test_generate_meta_info_has_sglangs_spec_fields_only_under_speculative_decoding():
    spec = ChoiceOutput("hi", [1, 2], STOP, 10, 2, spec_verify_ct=4, spec_accept_length=1.75)
    meta = generate_response(spec)["meta_info"]
    assert (meta["spec_verify_ct"], meta["spec_accept_length"]) == (4, 1.75)
    streamed = generate_progress(
        "h",
        [1],
        prompt_tokens=10,
        completion_tokens=1,
        cached_tokens=0,
        spec_verify_ct=0,
        spec_accept_length=0.0,
    )["meta_info"]
    assert (streamed["spec_verify_ct"], streamed["spec_accept_length"]) == (0, 0.0)
    assert not {"spec_verify_ct", "spec_accept_length"} & set(
        generate_response(choice())["meta_info"]
    )


def test_generate_reports_an_abort_in_finish_reason():
    aborted = choice(reason=FinishReason("abort", message="aborted by the client"))
    assert generate_response(aborted)["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "aborted by the client",
    }
