"""What the scheduler hands the metrics: prefix-cache hits and queries counted once per
request at its first admission — not again for its later chunks nor for its re-prefill
after a retraction — and one observer call per admission and per forward pass."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from engine.api import Engine
from engine.sched.req import Req


class Recorder:
    """A SchedulerObserver that remembers what it heard."""

    def __init__(self) -> None:
        self.admitted: list[str] = []
        self.forwards: Counter[str] = Counter()
        self.layers_done = 0

    def on_admit(self, req: Req) -> None:
        self.admitted.append(req.rid)

    def on_forward(self, mode: str, batch_size: int, seconds: float) -> None:
        assert batch_size >= 1 and seconds >= 0
        self.forwards[mode] += 1

    def on_progress(self) -> None:
        self.layers_done += 1


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_hits_count_once_per_request_through_chunks_and_retractions(
    tiny_model_dir: Path, overlap: bool
):
    rng = random.Random(3)
    prefix = [rng.randrange(3, 256) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(10)] for _ in range(12)]
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    with Engine(
        str(tiny_model_dir),
        dtype="float64",
        device="cpu",
        skip_tokenizer_init=True,
        max_total_tokens=400,
        chunked_prefill_size=32,
        disable_overlap_schedule=not overlap,
    ) as engine:
        stats = engine.scheduler.stats
        stats.observer = recorder = Recorder()
        results = engine.generate(prompts[:1], params)
        assert recorder.forwards["extend"] == 2  # its 50 prompt tokens went in chunks of 32
        layers = engine.model_runner.model_config.num_hidden_layers
        assert recorder.layers_done == 2 * layers  # each chunk's layers showed progress
        results += engine.generate(prompts[1:], params)
    assert stats.num_retractions > 0
    assert (
        stats.prefill_tokens > stats.cache_query_tokens - stats.cache_hit_tokens
    )  # retracted ones prefilled again
    assert sorted(Counter(recorder.admitted).values()) == [1] * len(prompts)
    assert stats.cache_query_tokens == sum(map(len, prompts))
    assert stats.cache_hit_tokens == sum(r.meta.cached_tokens for r in results) > 0
    assert recorder.forwards == Counter(stats.forward_modes)
    assert "observer" not in stats.counters()
