"""`benchmarks/quant_accuracy.py` drives a `ModelRunner` by hand, one decode step a token."""

from __future__ import annotations

from pathlib import Path

from benchmarks.quant_accuracy import runner_for, teacher_forced_logprobs
from testing.models import TINY_CONFIG, save_tiny_model


def test_a_sliding_window_model_takes_more_tokens_than_the_default_swa_pool_holds(
    tmp_path: Path,
) -> None:
    """At the default 0.8 sliding slots per full one, 200 tokens would overflow the sliding
    layers' pool: nothing frees the slots the window has passed."""
    model = save_tiny_model(tmp_path / "gemma3", "gemma3")
    tokens = list(range(1, 201))
    runner = runner_for(str(model), "float32", "none", "float", "float32", len(tokens))
    logprobs = teacher_forced_logprobs(runner, tokens)
    assert logprobs.shape == (len(tokens) - 1, TINY_CONFIG["vocab_size"])
