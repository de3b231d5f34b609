"""The embedded model's tokenizer (SmolLM2, ChatML), loaded once: it takes seconds; and the
app in process (`make_app`) with a scripted stand-in for the TokenizerManager (no sockets,
no worker), so that the HTTP layer is checked against known outputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import httpx2
import pytest
from transformers import PreTrainedTokenizerBase

from engine.model.tokenizer_cache import load_tokenizer
from services.io_struct import FinishReason, TokenizedGenerateReqInput, WorkerReady
from services.settings import Settings
from services.tokenizer import server
from services.tokenizer.manager import ReqOutput, unavailable


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer("embedded")


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


class InProcessApp:
    """`server.create_app`'s app called through ASGI: each call runs its lifespan, so the
    stand-in manager is in place."""

    def __init__(self, settings: Settings, tokenizer: PreTrainedTokenizerBase | None):
        self.app = server.create_app(settings, tokenizer)

    def request(self, method: str, path: str, body: Any = None) -> httpx2.Response:
        async def call() -> httpx2.Response:
            async with self.app.router.lifespan_context(self.app):
                transport = httpx2.ASGITransport(app=self.app)
                async with httpx2.AsyncClient(transport=transport, base_url="http://t") as client:
                    response = await client.request(method, path, json=body)
                    await response.aread()
                    return response

        return asyncio.run(call())

    def post(self, path: str, body: Any) -> tuple[int, str]:
        response = self.request("POST", path, body)
        return response.status_code, response.text


@pytest.fixture
def make_app(
    manager: ScriptedManager, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., InProcessApp]:
    """`make_app(settings, tokenizer=None)`: the app, served by `manager`."""

    @contextlib.asynccontextmanager
    async def running(*args: Any) -> AsyncIterator[ScriptedManager]:
        yield manager

    monkeypatch.setattr(server, "running_manager", running)
    return lambda settings, tokenizer=None: InProcessApp(settings, tokenizer)
