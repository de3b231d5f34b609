"""The request flow chat, completions and `/generate` share, in process: the app with a
scripted stand-in for the TokenizerManager (no sockets, no worker), so each `Endpoint` is
checked against the same outputs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.settings import Settings
from tests.services.tokenizer.conftest import ABORTED, FAILS, ScriptedManager


@pytest.fixture
def post(make_app: Any) -> Any:
    """`post(path, body)` → (status, body text) from an app served by `manager`."""
    return make_app(Settings(model="m")).post


def events(text: str) -> list[Any]:
    """An SSE body as its JSON events, with "[DONE]" kept as a string."""
    chunks = [c for c in text.split("\n\n") if c]
    assert all(c.startswith("data: ") for c in chunks)
    return [c[6:] if c == "data: [DONE]" else json.loads(c[6:]) for c in chunks]


def test_native_generate_streams_each_prompts_answer_so_far_then_done(post: Any):
    status, text = post("/generate", {"input_ids": [[1, 2], [3]], "stream": True})
    assert status == 200
    *answers, done = events(text)
    assert done == "[DONE]"
    assert [(a["index"], a["text"], a["output_ids"]) for a in answers] == [
        (0, "a", [10]),
        (1, "a", [10]),
        (0, "ab", [10, 11]),
        (1, "ab", [10, 11]),
    ]
    assert answers[0]["meta_info"]["finish_reason"] is None
    assert answers[-1]["meta_info"]["finish_reason"] == {"type": "length"}


def test_native_generate_answers_one_prompt_with_an_object_and_a_batch_with_a_list(post: Any):
    _, one = post("/generate", {"input_ids": [1, 2]})
    _, batch = post("/generate", {"input_ids": [[1, 2]]})
    assert json.loads(one)["text"] == "ab"
    assert [a["text"] for a in json.loads(batch)] == ["ab"]


def test_an_abort_fails_an_openai_request_but_is_a_native_finish_reason(post: Any):
    status, text = post("/v1/completions", {"prompt": [1, ABORTED]})
    assert status == 400 and json.loads(text)["error"]["code"] == "request_aborted"
    status, text = post("/generate", {"input_ids": [1, ABORTED]})
    assert status == 200
    assert json.loads(text)["meta_info"]["finish_reason"] == {"type": "abort", "message": "refused"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [1, FAILS], "stream": True}),
        ("/generate", {"input_ids": [1, FAILS], "stream": True}),
    ],
)
def test_a_failure_after_the_200_ends_every_stream_with_an_error_event_then_done(
    post: Any, path: str, body: dict[str, Any]
):
    status, text = post(path, body)
    assert status == 200
    *_, error, done = events(text)
    assert error["error"]["code"] == "service_unavailable" and done == "[DONE]"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [[1]] * 1025}, "prompt"),
        ("/v1/completions", {"prompt": [[1]] * 600, "n": 2}, "n"),
        ("/generate", {"input_ids": [[1]] * 1025}, "input_ids"),
        ("/generate", {"input_ids": [[1]] * 600, "sampling_params": {"n": 2}}, "sampling_params.n"),
    ],
)
def test_too_many_sequences_are_refused_naming_the_endpoints_own_field(
    post: Any, manager: ScriptedManager, path: str, body: dict[str, Any], param: str
):
    status, text = post(path, body)
    assert status == 400 and json.loads(text)["error"]["param"] == param
    assert manager.submitted == []


def test_openai_n_is_refused_before_the_prompt_is_tokenized(post: Any):
    # The server has no tokenizer: tokenizing the text would be the error otherwise.
    status, text = post("/v1/completions", {"prompt": "hi", "n": 2000})
    assert status == 400 and json.loads(text)["error"]["param"] == "n"


def test_the_requests_of_one_answer_are_named_after_its_id(post: Any, manager: ScriptedManager):
    _, text = post("/v1/completions", {"prompt": [[1], [2]], "n": 2, "seed": 7})
    answer = json.loads(text)
    assert [r.rid for r in manager.submitted] == [f"{answer['id']}-{i}" for i in range(4)]
    assert [r.sampling_params.seed for r in manager.submitted] == [7, 8, 7, 8]
    assert [c["text"] for c in answer["choices"]] == ["ab"] * 4


N_FIELDS = [
    ("/v1/completions", {"prompt": [1]}, "n"),
    ("/v1/completions/render", {"prompt": [1]}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "n"),
    ("/generate", {"text": "hi"}, "sampling_params.n"),
]
"""A body per endpoint that fans out, and the field that carries its `n`."""


def _with_n(body: dict[str, Any], param: str, n: int) -> dict[str, Any]:
    if param == "sampling_params.n":
        return {**body, "sampling_params": {"n": n}}
    return {**body, "n": n}


@pytest.mark.parametrize(("path", "body", "param"), N_FIELDS)
def test_n_above_max_n_is_refused_naming_the_limit_and_the_flag_before_tokenizing(
    post: Any, manager: ScriptedManager, path: str, body: dict[str, Any], param: str
):
    # The server has no tokenizer: a text prompt would be refused for that otherwise.
    status, text = post(path, _with_n(body, param, 129))
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param, text
    assert "at most 128" in error["message"] and "--max-n" in error["message"]
    assert error["type"] == "invalid_request_error" and error["code"] == "integer_above_max_value"
    assert manager.submitted == []


def test_n_up_to_max_n_is_served_and_the_flag_moves_the_limit(
    make_app: Any, manager: ScriptedManager
):
    status, _ = make_app(Settings(model="m")).post("/v1/completions", {"prompt": [1], "n": 128})
    assert status == 200 and len(manager.submitted) == 128
    app = make_app(Settings(model="m", max_n=2))
    status, text = app.post("/generate", {"input_ids": [1], "sampling_params": {"n": 3}})
    assert status == 400 and "at most 2 samples" in json.loads(text)["error"]["message"]
    status, _ = app.post("/generate", {"input_ids": [1], "sampling_params": {"n": 2}})
    assert status == 200 and len(manager.submitted) == 130


def test_max_sequences_per_request_bounds_prompts_times_n(make_app: Any):
    app = make_app(Settings(model="m", max_sequences_per_request=4))
    status, text = app.post("/v1/completions", {"prompt": [[1]] * 5})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "prompt"
    assert "--max-sequences-per-request" in error["message"]
    status, text = app.post("/v1/completions", {"prompt": [[1]] * 3, "n": 2})
    assert status == 400 and json.loads(text)["error"]["param"] == "n"
    assert app.post("/v1/completions", {"prompt": [[1]] * 2, "n": 2})[0] == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": [1], "stream_options": {"include_usage": True}}),
        ("/generate", {"input_ids": [1]}),
    ],
)
def test_openai_and_native_streams_end_with_done_after_their_last_chunk(
    make_app: Any, tokenizer: Any, path: str, body: dict[str, Any]
):
    status, text = make_app(Settings(model="m"), tokenizer).post(path, {**body, "stream": True})
    assert status == 200
    *chunks, last, done = events(text)
    assert done == "[DONE]" and "[DONE]" not in chunks and isinstance(last, dict)
    if "stream_options" in body:
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_a_responses_stream_ends_with_its_last_event_and_no_done(make_app: Any, tokenizer: Any):
    app = make_app(Settings(model="m"), tokenizer)
    status, text = app.post("/v1/responses", {"input": "hi", "stream": True})
    assert status == 200
    names = [c.split("\n", 1)[0] for c in text.split("\n\n") if c]
    assert names[0] == "event: response.created"
    assert names[-1] == "event: response.incomplete"  # the scripted worker stops at length
    assert "[DONE]" not in text
