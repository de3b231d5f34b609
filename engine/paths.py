"""Where radixserve keeps what it derives from model files and from its own sources: one
cache directory, with a subdirectory for each kind of thing kept there. Everything in it can
be deleted; it is rebuilt on the next use."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"
"""Overrides the cache directory (default: `$XDG_CACHE_HOME/radixserve`, else
`~/.cache/radixserve`)."""


def cache_root() -> Path:
    if root := os.environ.get(CACHE_DIR_ENV):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "radixserve"


def cpu_kernels_dir() -> Path:
    """The CPU kernels' builds, one per machine, kernel path and sources
    (`engine/kernels/cpu/build.py`)."""
    return cache_root() / "cpu_kernels"


def models_dir() -> Path:
    """Embedded models assembled from their packages (`engine/model/embedded.py`)."""
    return cache_root() / "models"


def tokenizers_dir() -> Path:
    """GGUF files' tokenizers, converted once (`engine/model/tokenizer_cache.py`)."""
    return cache_root() / "tokenizers"


def inductor_dir() -> Path:
    """torch.compile's compiled kernels, the default `$TORCHINDUCTOR_CACHE_DIR` of
    `--enable-torch-compile` (`engine/model/graph_runner.py`)."""
    return cache_root() / "inductor"
