"""`/tokenize` over every input shape and flag of its two request models, against what the
tokenizer itself gives: a prompt is `tokenizer(prompt, add_special_tokens=...)`, a
conversation is its chat-template text tokenized the same way (vLLM's reading). Run with
the embedded SmolLM2 tokenizer, which adds no special tokens, and with a copy whose
post-processor adds a BOS and an EOS, so that `add_special_tokens` changes the answer."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerBase

from services.settings import Settings
from services.tokenizer.chat_template import render_chat
from services.tokenizer.protocol.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from tests.services.tokenizer.conftest import InProcessApp, ScriptedManager

CONTEXT = ScriptedManager().worker_info.context_length
UNSET = object()
"""A flag left out of the body."""

PROMPTS = ["The cat sat", " leading space", "<|im_start|>system"]
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Tell me a story."}],
    "system and user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ],
    "to continue": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two"},
    ],
    "tool call and result": [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module", params=["plain", "bos and eos"])
def any_tokenizer(
    request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedTokenizerBase:
    if request.param == "plain":
        return tokenizer
    framed = copy.deepcopy(tokenizer)
    bos, eos = framed.bos_token, framed.eos_token
    framed.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}",
        pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, framed.bos_token_id), (eos, framed.eos_token_id)],
    )
    assert framed("a")["input_ids"][0] == framed.bos_token_id
    return framed


@pytest.fixture
def app(make_app: Any, any_tokenizer: PreTrainedTokenizerBase) -> InProcessApp:
    return make_app(Settings(model="m"), any_tokenizer)


def _flags(**values: object) -> dict[str, object]:
    return {k: v for k, v in values.items() if v is not UNSET}


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("add_special_tokens", [True, False, UNSET])
@pytest.mark.parametrize("return_token_strs", [True, False, UNSET])
def test_a_prompt_tokenizes_as_the_tokenizer_does(
    app: InProcessApp,
    any_tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    add_special_tokens: object,
    return_token_strs: object,
):
    flags = _flags(add_special_tokens=add_special_tokens, return_token_strs=return_token_strs)
    status, text = app.post("/tokenize", {"prompt": prompt, **flags})
    assert status == 200, text
    special = add_special_tokens is not False  # vLLM's default for a prompt: true
    expected = any_tokenizer(prompt, add_special_tokens=special)["input_ids"]
    strs = any_tokenizer.convert_ids_to_tokens(expected) if return_token_strs is True else None
    assert json.loads(text) == {
        "count": len(expected),
        "max_model_len": CONTEXT,
        "tokens": expected,
        "token_strs": strs,
    }


CHAT_FLAGS = list(
    itertools.product(
        [True, False, UNSET],  # add_generation_prompt
        [True, False, UNSET],  # continue_final_message
        [True, False, UNSET],  # add_special_tokens
    )
)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize(
    ("add_generation_prompt", "continue_final_message", "add_special_tokens"), CHAT_FLAGS
)
def test_a_conversation_tokenizes_as_its_template_text_does(
    app: InProcessApp,
    any_tokenizer: PreTrainedTokenizerBase,
    conversation: str,
    add_generation_prompt: object,
    continue_final_message: object,
    add_special_tokens: object,
):
    messages = CONVERSATIONS[conversation]
    flags = _flags(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        add_special_tokens=add_special_tokens,
    )
    status, text = app.post("/v1/tokenize", {"messages": messages, **flags})
    generation, continuation = add_generation_prompt is not False, continue_final_message is True
    if generation and continuation:
        assert status == 400 and json.loads(text)["error"]["param"] == "continue_final_message"
        return
    assert status == 200, text
    if "tool" in conversation:  # the template cannot render tools: radixserve writes them in
        template_text = render_chat(
            any_tokenizer,
            [ChatCompletionMessageParam.model_validate(m) for m in messages],
            add_generation_prompt=generation,
            continue_final_message=continuation,
        ).text
    else:
        template_text = any_tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=generation,
            continue_final_message=continuation,
            tokenize=False,
        )
    special = add_special_tokens is True  # vLLM's default for a conversation: false
    expected = any_tokenizer(template_text, add_special_tokens=special)["input_ids"]
    assert json.loads(text)["tokens"] == expected


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_conversation_with_tools_and_template_kwargs_is_what_chat_renders(
    app: InProcessApp, any_tokenizer: PreTrainedTokenizerBase, add_special_tokens: bool
):
    messages = CONVERSATIONS["user"]
    body = {
        "messages": messages,
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
        "add_special_tokens": add_special_tokens,
        "return_token_strs": True,
    }
    status, text = app.post("/tokenize", body)
    assert status == 200, text
    rendered = render_chat(
        any_tokenizer,
        [ChatCompletionMessageParam.model_validate(m) for m in messages],
        tools=[ChatCompletionToolParam.model_validate(t) for t in TOOLS],
        template_kwargs={"enable_thinking": False},
    )
    assert "weather" in rendered.text
    expected = any_tokenizer(rendered.text, add_special_tokens=add_special_tokens)["input_ids"]
    answer = json.loads(text)
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["token_strs"] == any_tokenizer.convert_ids_to_tokens(expected)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2]}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": CONVERSATIONS["user"], "add_generation_prompt": 1}, "add_generation_prompt"),
        (
            {"messages": CONVERSATIONS["user"], "chat_template_kwargs": {"tools": []}},
            "chat_template_kwargs",
        ),
        ({"model": "other", "prompt": "a"}, "model"),
    ],
)
def test_a_bad_tokenize_request_is_a_4xx_naming_its_field(
    app: InProcessApp, body: dict[str, Any], param: str
):
    status, text = app.post("/tokenize", body)
    error = json.loads(text)["error"]
    assert 400 <= status < 500 and error["param"] == param, text
