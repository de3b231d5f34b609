"""A GGUF's tokenizer is converted once, then read back from the cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model.embedded import embedded_model_path
from engine.model.tokenizer_cache import cached_tokenizer_dir, load_tokenizer, store_tokenizer
from engine.paths import CACHE_DIR_ENV

TEXTS = [
    "Hello world!",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading spaces\t\ttabs\n\ntrailing  ",
    "émoji 🤖 中文 Ünïcödé",
    "def f(x):\n    return x ** 2  # code",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]


def test_a_gguf_tokenizer_read_back_from_the_cache_equals_the_converted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    cached = cached_tokenizer_dir(embedded_model_path())
    assert not cached.exists()
    converted = load_tokenizer("embedded")
    assert (cached / "tokenizer.json").is_file()
    restored = load_tokenizer("embedded")
    assert restored.get_vocab() == converted.get_vocab()
    assert restored.all_special_tokens == converted.all_special_tokens
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(restored, attr) == getattr(converted, attr), attr
    for text in TEXTS:
        ids = converted.encode(text)
        assert restored.encode(text) == ids, text
        for skip in (False, True):
            assert restored.decode(ids, skip_special_tokens=skip) == converted.decode(
                ids, skip_special_tokens=skip
            )
    template = dict(tokenize=False, add_generation_prompt=True)
    assert restored.apply_chat_template(CHAT, **template) == converted.apply_chat_template(
        CHAT, **template
    )


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path: Path, embedded_tokenizer):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert not store_tokenizer(embedded_tokenizer, not_a_dir / "tokenizers" / "x")
    assert store_tokenizer(embedded_tokenizer, tmp_path / "tokenizers" / "x")
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == ["x"]  # no staging left
