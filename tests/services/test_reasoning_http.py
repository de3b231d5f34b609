"""Reasoning models through the three processes: `--reasoning-parser` splits the
`<think>` section into `reasoning_content`, streamed deltas join to the unstreamed answer,
and a grammar constrains only what follows `</think>`. The model is the tiny Llama whose
vocabulary has `<think>` and `</think>` as single tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from engine.model.tokenizer_cache import load_tokenizer
from testing.launcher import ServiceLauncher, cpu_flags
from testing.models import save_tiny_thinking_llama
from testing.net import all_kv_free

USER = [{"role": "user", "content": "Is the sky blue?"}]
YES_NO = {"structured_outputs": {"choice": ["yes", "no"]}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_thinking_llama(tmp_path_factory.mktemp("tiny-thinking-llama"))


@pytest.fixture(scope="module")
def think_end(model_dir: Path) -> int:
    (token,) = load_tokenizer(str(model_dir)).encode("</think>", add_special_tokens=False)
    return token


@pytest.fixture(scope="module")
def http(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx2.Client]:
    launcher = ServiceLauncher(tmp_path_factory.mktemp("reasoning-logs"))
    flags = [*cpu_flags(2048, model_dir), "--reasoning-parser", "deepseek_r1"]
    with launcher.serve(flags) as url, httpx2.Client(base_url=url, timeout=120) as client:
        yield client


def chat(http: httpx2.Client, **fields: object) -> dict:
    body = {"messages": USER, "temperature": 0, "max_tokens": 12, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed(http: httpx2.Client, **fields: object) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) joined from a stream's deltas."""
    body = {"messages": USER, "temperature": 0, "max_tokens": 12, "stream": True, **fields}
    reasoning, content, reason = [], [], None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = httpx2.Response(200, content=line[6:]).json()["choices"][0]
            reasoning.append(choice["delta"].get("reasoning_content") or "")
            content.append(choice["delta"].get("content") or "")
            reason = choice["finish_reason"] or reason
    return "".join(reasoning), "".join(content), reason


def test_output_before_the_end_token_is_reasoning_and_streams_the_same(http: httpx2.Client):
    """deepseek_r1's outputs start inside the section: with no `</think>` sampled, it is
    all reasoning."""
    choice = chat(http, logit_bias={})
    message = choice["message"]
    assert message["reasoning_content"] and message["content"] in (None, "")
    assert streamed(http) == (message["reasoning_content"], "", choice["finish_reason"])


def test_a_grammar_constrains_only_what_follows_the_reasoning(http: httpx2.Client, think_end):
    """The bias makes `</think>` the greedy first token; a grammar active from the start
    would forbid it. After it, the answer is held to the grammar's two words."""
    choice = chat(http, logit_bias={str(think_end): 100}, **YES_NO)
    assert choice["message"]["content"] in ("yes", "no")
    assert choice["message"].get("reasoning_content") is None
    assert choice["finish_reason"] == "stop"
    assert streamed(http, logit_bias={str(think_end): 100}, **YES_NO) == (
        "",
        choice["message"]["content"],
        "stop",
    )


def test_thinking_disabled_by_the_template_leaves_all_content(http: httpx2.Client, think_end):
    """A prompt whose template closed the section (continuing an assistant turn that
    ends with `</think>`) has no reasoning: the grammar applies from the first token."""
    messages = [*USER, {"role": "assistant", "content": "<think>\n</think>\n"}]
    choice = chat(
        http,
        messages=messages,
        add_generation_prompt=False,
        continue_final_message=True,
        logit_bias={str(think_end): 100},
        **YES_NO,
    )
    assert choice["message"]["content"] in ("yes", "no")
    assert choice["message"].get("reasoning_content") is None


def test_no_kv_leaked(http: httpx2.Client):
    assert all_kv_free(http)
