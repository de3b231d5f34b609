"""`--grammar-backend none` switches structured output off: grammars are refused up front."""

from pathlib import Path

import pytest

from engine.api import Engine


def tiny_engine(model_dir: Path, **options: str) -> Engine:
    return Engine(str(model_dir), dtype="float32", device="cpu", max_total_tokens=1024, **options)


def test_grammar_backend_none_refuses_grammars_and_serves_plain_requests(tiny_llama_dir: Path):
    with tiny_engine(tiny_llama_dir, grammar_backend="none") as engine:
        assert engine.scheduler.grammar_backend is None
        with pytest.raises(ValueError, match="--grammar-backend none"):
            engine.generate("Pick:", {"regex": "a|b"})
        assert not engine.scheduler.has_work()
        plain = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
        assert len(engine.generate("Pick:", plain)[0].output_ids) == 3


def test_grammar_backend_auto_is_the_default_with_both_libraries(tiny_llama_dir: Path):
    with tiny_engine(tiny_llama_dir) as engine:
        backend = engine.scheduler.grammar_backend
        assert backend is not None and backend.name == "auto"
        assert sorted(backend.compilers) == ["llguidance", "xgrammar"]
