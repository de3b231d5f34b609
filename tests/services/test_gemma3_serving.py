"""`radixserve serve --model gemma3-270m` on real processes: the base model's GGUF has no
chat template, so completions are served and chat is a 400 naming `messages`, until
`--chat-template gemma3` gives it Gemma's turns; an answer then stops on `<end_of_turn>`."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from engine.model.embedded import GEMMA3_MODEL
from engine.model.tokenizer_cache import load_tokenizer
from services.chat_templates import read_chat_template
from services.tokenizer.chat_template import render_chat, turn_end_ids
from services.tokenizer.protocol.chat import ChatCompletionRequest
from testing.launcher import serving, start_serve

FLAGS = ["--model", GEMMA3_MODEL, "--device", "cpu", "--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def gemma_tokenizer():
    return load_tokenizer(GEMMA3_MODEL)


def test_gemma3_template_writes_gemma_turns_and_ends_them(gemma_tokenizer):
    tokenizer = gemma_tokenizer
    assert turn_end_ids(tokenizer) == ()  # the file carries no template
    tokenizer.chat_template = read_chat_template("gemma3")
    try:
        body = ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Capital of France?"},
                ],
            }
        )
        prompt = render_chat(tokenizer, body.messages)
        assert turn_end_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
    finally:
        tokenizer.chat_template = None
    assert prompt.text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert prompt.ids[0] == tokenizer.bos_token_id
    assert prompt.ids.count(tokenizer.convert_tokens_to_ids("<start_of_turn>")) == 4


@pytest.mark.timeout(300)
def test_gemma3_serves_completions_and_refuses_chat_without_a_template(tmp_path: Path):
    with serving(FLAGS, tmp_path / "serve.log") as client:
        info = client.models.list()
        answer = client.completions.create(
            model=GEMMA3_MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=GEMMA3_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    assert [m.id for m in info.data] == [GEMMA3_MODEL]
    assert (
        "France" in answer.choices[0].text
    )  # the base model: " the capital of the country of France."
    assert refused.value.body["param"] == "messages"
    assert "chat template" in refused.value.body["message"]


@pytest.mark.timeout(300)
def test_gemma3_chats_with_the_named_template_and_stops_on_end_of_turn(tmp_path: Path):
    messages = [{"role": "user", "content": "Say hello."}]
    with serving([*FLAGS, "--chat-template", "gemma3"], tmp_path / "serve.log") as client:
        answer = client.chat.completions.create(
            model=GEMMA3_MODEL, messages=messages, max_tokens=16, temperature=0
        )
        # <end_of_turn> (106) made certain: the base model's EOS is <eos>, so only the
        # template's turn end can stop it here.
        ended = client.chat.completions.create(
            model=GEMMA3_MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0,
            logit_bias={"106": 100},
        )
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens == 12  # <bos>, two turns' markup and 3 words
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    assert ended.choices[0].message.content == ""


def test_an_unknown_chat_template_is_refused_in_one_line(tmp_path: Path):
    serve = start_serve([*FLAGS, "--chat-template", "nope"], tmp_path / "serve.log")
    _, stderr = serve.communicate(timeout=60)
    log = (tmp_path / "serve.log").read_text()
    assert serve.returncode == 2
    assert "--chat-template 'nope' is neither a named template (gemma3) nor a file" in (
        log + (stderr or "")
    )
    assert "Traceback" not in log
