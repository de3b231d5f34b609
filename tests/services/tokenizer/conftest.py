"""The embedded model's tokenizer (SmolLM2, ChatML), loaded once: it takes seconds."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from engine.model.loader import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer("embedded")
