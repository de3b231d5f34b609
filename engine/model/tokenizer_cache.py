"""A model's tokenizer, without torch's engine side (the tokenizer and detokenizer load
it); a GGUF file's tokenizer is converted once and kept on disk.

transformers builds a GGUF's tokenizer from its metadata (vocabulary, merges, special
tokens, chat template) in Python, seconds for a vocabulary of tens of thousands of tokens,
paid by every process that loads it (the tokenizer and the detokenizer at each start). The
result saved with `save_pretrained` loads many times faster (docs/benchmarks/model.md, "What
a first start pays once"), so the first load keeps it under the cache directory
(`engine/paths.py`), keyed by the file's path, size and modification time and by the
transformers version that converted it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model.source import ModelSource, resolve_model
from engine.paths import tokenizers_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(model: str | os.PathLike[str] | ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer; from a GGUF file, transformers builds it from the metadata
    (vocabulary, merges, special ids and chat template), once per file (`load_gguf_tokenizer`)."""
    started = time.perf_counter()
    from transformers import AutoTokenizer  # seconds of imports, the first time

    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if source.is_gguf:
        tokenizer = load_gguf_tokenizer(source.path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(source.path)
    logger.info("tokenizer: loaded in %.1f s", time.perf_counter() - started)
    return tokenizer


def cached_tokenizer_dir(gguf_path: Path) -> Path:
    """Where the converted tokenizer of `gguf_path` lives (it may not exist yet)."""
    import transformers

    stat = gguf_path.stat()
    identity = (
        f"{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return tokenizers_dir() / f"{gguf_path.stem}-{digest}"


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of `gguf_path`, from the cache when an earlier load converted it."""
    from transformers import AutoTokenizer

    cached = cached_tokenizer_dir(gguf_path)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    store_tokenizer(tokenizer, cached)
    return tokenizer


def store_tokenizer(tokenizer: PreTrainedTokenizerBase, cached: Path) -> bool:
    """Save `tokenizer` as `cached`, all of it or nothing; False when that cannot be done.
    The cache is a convenience: a directory that cannot be written (a read-only root
    filesystem) only means converting on every load."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}-", dir=cached.parent))
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(cached)  # atomic: a concurrent load sees all of it or nothing
        except OSError:  # another process stored it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        logger.info("not caching the tokenizer in %s: %s", cached, err)
        return False
    return True
