"""The request flow chat, completions and `/generate` share, in process: the app with a
scripted stand-in for the TokenizerManager (no sockets, no worker), so each endpoint's
adapter is checked against the same outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import httpx2
import pytest

from services.protocol import FinishReason, TokenizedGenerateReqInput, WorkerReady
from services.settings import Settings
from services.tokenizer import server
from services.tokenizer.manager import ReqOutput, unavailable

ABORTED = 13
"""A prompt holding this token id is aborted by the scripted worker (a 400 refusal)."""
FAILS = 14
"""A prompt holding this token id loses its worker after the first output (a 503)."""


class ScriptedManager:
    """Answers every request with two outputs: "a" then "b" (its last, or its abort)."""

    def __init__(self) -> None:
        self.worker_info = WorkerReady(
            model_path="m",
            served_model_name="m",
            max_total_tokens=4096,
            context_length=64,
            vocab_size=100,
            eos_token_ids=[2],
            max_running_requests=8,
        )
        self.submitted: list[TokenizedGenerateReqInput] = []
        self.lora_adapters: dict[str, str] = {}

    def require_ready(self, peers: Sequence[str] = ()) -> WorkerReady:
        return self.worker_info

    def check_capacity(self, num_reqs: int) -> None:
        pass

    async def generate(
        self, reqs: Sequence[TokenizedGenerateReqInput], observed: bool = True
    ) -> AsyncGenerator[ReqOutput, None]:
        self.submitted.extend(reqs)
        for step, text in enumerate("ab"):
            for i, req in enumerate(reqs):
                if FAILS in req.input_ids and step == 1:
                    raise unavailable("the worker process stopped responding; retry it")
                reason = None
                if step == 1:
                    aborted = ABORTED in req.input_ids
                    reason = (
                        FinishReason("abort", message="refused", status_code=400)
                        if aborted
                        else FinishReason("length")
                    )
                yield ReqOutput(i, req.rid, text, [10 + step], reason, 3, step + 1, 0)


@pytest.fixture
def manager() -> ScriptedManager:
    return ScriptedManager()


@pytest.fixture
def post(manager: ScriptedManager, monkeypatch: pytest.MonkeyPatch) -> Any:
    """`post(path, body)` → (status, body text) from an app served by `manager`."""

    @contextlib.asynccontextmanager
    async def running(*args: Any) -> AsyncIterator[ScriptedManager]:
        yield manager

    monkeypatch.setattr(server, "running_manager", running)
    app = server.create_app(Settings(model="m"), tokenizer=None)

    async def call(path: str, body: dict[str, Any]) -> tuple[int, str]:
        async with app.router.lifespan_context(app):
            transport = httpx2.ASGITransport(app=app)
            async with httpx2.AsyncClient(transport=transport, base_url="http://t") as client:
                response = await client.post(path, json=body)
                return response.status_code, response.text

    return lambda path, body: asyncio.run(call(path, body))


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
