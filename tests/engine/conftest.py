"""An Engine on the tiny Llama (`tiny_model_dir`), for engine-level tests.

float64 throughout: tiny random models have nearly flat logits, and fp32 rounding alone
would flip greedy tokens between batch layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.api import Engine


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator[Callable[..., Engine]]:
    """`make_engine(**options)`: an Engine on the tiny model, shut down after the test."""
    engines: list[Engine] = []

    def make(**options: Any) -> Engine:
        defaults = dict(
            dtype="float64", device="cpu", skip_tokenizer_init=True, max_total_tokens=8192
        )
        engine = Engine(str(tiny_model_dir), **{**defaults, **options})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
