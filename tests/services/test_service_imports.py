"""The tokenizer and detokenizer processes never import the engine's model code (its
layers, kernels and loader): they need a tokenizer, which `engine.model.tokenizer_cache`
loads without it. The detokenizer's own modules and the wire's message types are
torch-free; torch reaches both processes only through transformers (and the tokenizer's
grammar checks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_CODE = (
    "engine.model.loader",
    "engine.model.layers",
    "engine.model.models",
    "engine.kernels",
    "engine.model.attention",
)


def modules_after_import(*modules: str) -> set[str]:
    """`sys.modules` of a fresh interpreter that imported `modules`."""
    code = f"import sys, {', '.join(modules)}; print(chr(10).join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


def test_the_detokenizer_and_the_wire_types_import_no_torch():
    loaded = modules_after_import(
        "services.detokenizer.__main__", "services.io_struct", "engine.model.tokenizer_cache"
    )
    assert "services.detokenizer.detokenizer" in loaded
    assert "torch" not in loaded


def test_the_tokenizer_and_detokenizer_import_no_model_code():
    loaded = modules_after_import("services.tokenizer.__main__", "services.detokenizer.__main__")
    assert "services.tokenizer.server" in loaded
    assert sorted(m for m in loaded if m.startswith(MODEL_CODE)) == []
