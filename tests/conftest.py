"""Suite-wide settings (Triton's interpreter on machines without a GPU, the hypothesis
profile) and the tiny models that tests in several folders load."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when it decorates a kernel, and transformers imports
# triton.language early: without a GPU, the Triton kernels run under the interpreter only if
# this is set before anything imports Triton.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

settings.register_profile(
    "radixserve",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("radixserve")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 256-token vocabulary and no tokenizer, for engine tests that
    feed token ids."""
    from testing.models import save_tiny_model  # torch: not for the deploy tests

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with the SmolLM2 vocabulary and tokenizer, which the services load in
    seconds and which decodes real text."""
    from testing.models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-smollm2-vocab"))


@pytest.fixture(scope="session")
def tokenizer(tiny_llama_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with `tiny_llama_dir` (SmolLM2's)."""
    from engine.model.tokenizer_cache import load_tokenizer

    return load_tokenizer(str(tiny_llama_dir))
