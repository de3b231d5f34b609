"""Speculative decoding at tp_size=2 (two real processes over gloo), in a module of its own:
one tensor-parallel group per process at a time, and test_tensor_parallel.py keeps one up
for its whole module."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.api import Engine
from tests.engine.test_tensor_parallel import GREEDY, OPTIONS, prompt


@pytest.mark.timeout(300)
def test_tp2_speculative_decoding_generates_what_tp1_does(tiny_llama_dir: Path):
    """NGRAM at tp_size=2: both ranks feed their tries the same tokens, draft the same
    trees and walk them over rank 0's draws (an unseeded sampled request among them takes
    the all-gather), in step, and generate what tp_size=1 does for greedy and seeded
    requests; the second round drafts from the first's outputs."""
    prompts = [prompt(20 + i, 16) for i in range(4)]
    params = [
        {**GREEDY, "max_new_tokens": 24},
        {"temperature": 0.9, "seed": 3, "max_new_tokens": 24, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 24},
        {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True},
    ]
    options = {**OPTIONS, "max_total_tokens": 2048, "speculative_algorithm": "NGRAM"}
    results = []
    for tp_size in (1, 2):
        with Engine(str(tiny_llama_dir), tp_size=tp_size, **options) as engine:
            runs = [[r.output_ids for r in engine.generate(prompts, params)][:3] for _ in range(2)]
            results.append((runs, engine.scheduler.stats.spec_accepted_tokens))
    assert results[0][0] == results[1][0]
    assert results[0][1] > 0 and results[1][1] > 0
