"""Where a model is and what it is, without torch: the tokenizer and detokenizer find their
tokenizer here, and `radixserve serve` refuses a model it cannot serve before any process
starts.

A model is named by a local Hugging Face directory (config.json + safetensors, sharded or
not), a GGUF file (or a directory holding exactly one), `embedded` or `gemma3-270m` (GGUFs
shipped as packages, `engine/model/embedded.py`), or a Hugging Face Hub repo id, downloaded
once with `huggingface_hub`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt

from engine.model.config import GGUF_ARCH_TO_ARCHITECTURE, ModelConfig
from engine.model.embedded import EMBEDDED_MODEL, GEMMA3_MODEL, embedded_model_path, is_embedded

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]
# Mistral repos also hold consolidated.safetensors, the same weights under other names.
HUB_IGNORE_PATTERNS = ["consolidated*"]
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
"""The Hugging Face architectures there is a network for: the keys of
`engine.model.models.MODEL_REGISTRY`, which imports torch (tests/engine/model/test_source.py
keeps the two equal)."""
MODEL_FORMS = (
    f"a Hugging Face directory, a .gguf file, a Hub repo id, {EMBEDDED_MODEL!r} or {GEMMA3_MODEL!r}"
)
"""What `--model` accepts, for the messages that refuse one."""


@dataclass(frozen=True)
class ModelSource:
    """A model on local disk: a Hugging Face directory, or one GGUF file."""

    path: Path
    is_gguf: bool


def resolve_model(model: str | os.PathLike[str]) -> ModelSource:
    """The model on disk; a Hub repo id is downloaded. A name that can only be a local path
    (absolute, relative to `.` or `~`, or a .gguf file) and is missing is refused, not
    looked up on the Hub."""
    if is_embedded(model):
        return ModelSource(embedded_model_path(str(model)), is_gguf=True)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf file; "
                "pass a GGUF file or a Hugging Face directory"
            )
        return ModelSource(path, is_gguf=True)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, is_gguf=False)
        gguf_files = sorted(path.glob("*.gguf"))
        if len(gguf_files) == 1:
            return ModelSource(gguf_files[0], is_gguf=True)
        raise FileNotFoundError(f"{path} holds neither a config.json nor exactly one .gguf file")
    if is_local_path(str(model)):
        raise FileNotFoundError(f"model {str(model)!r} does not exist (a model is {MODEL_FORMS})")
    return ModelSource(download_from_hub(str(model)), is_gguf=False)


def is_local_path(model: str) -> bool:
    """Whether `model` names a local file or directory and cannot be a Hub repo id."""
    return model.startswith(("/", ".", "~")) or model.endswith(".gguf")


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot of a Hub repo (config, safetensors, tokenizer files)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS
            )
        )
    except (OSError, ValueError) as err:  # no network, unknown repo, malformed id
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local directory or GGUF file, and downloading it "
            f"from the Hugging Face Hub failed: {err}. Without a network, pass a local path "
            f"or {EMBEDDED_MODEL!r}."
        ) from err


def local_config(model: str) -> ModelConfig | None:
    """The description of a model on this machine (`embedded`, or a path), read without
    torch and without loading weights, so that a server refuses what it cannot serve before
    it starts; None for a Hub repo id, which the loader downloads. Refusals are one-line
    ValueErrors (FileNotFoundError for a missing path) naming what was found."""
    if not is_embedded(model) and not is_local_path(model) and not Path(model).exists():
        return None
    source = resolve_model(model)
    config = read_config(source)
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source.path}: model architecture {config.architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return config


def read_config(source: ModelSource) -> ModelConfig:
    """The model's description, from its config.json or its GGUF metadata; a file that
    cannot be parsed, or lacks a key, is refused with a ValueError that names it."""
    if not source.is_gguf:
        try:
            return ModelConfig.from_hf(source.path)
        except KeyError as err:
            raise ValueError(f"{source.path}: config.json lacks {err}") from err
        except (ValueError, OSError) as err:  # not JSON, unreadable
            raise ValueError(f"{source.path}: config.json cannot be read ({err})") from err
    try:
        reader = GGUFReader(source.path)
    except (ValueError, IndexError, OSError) as err:  # bad magic, truncated, unreadable
        raise ValueError(
            f"{source.path} is not a readable GGUF file ({err}); supported: GGUF files of "
            f"the architectures {', '.join(GGUF_ARCH_TO_ARCHITECTURE)}"
        ) from err
    try:
        return ModelConfig.from_gguf(reader)
    except KeyError as err:
        raise ValueError(f"{source.path}: the GGUF metadata lacks {err}") from err
    except ValueError as err:
        raise ValueError(f"{source.path}: {err}") from err


class GGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` reading through a plain ndarray view of its memmap. The stock
    reader slices the memmap once per value, and numpy's per-slice memmap bookkeeping makes
    parsing a 49k-token vocabulary take seconds; the bytes read are the same."""

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        if "_buffer" not in self.__dict__:
            self._buffer = self.data.view(np.ndarray)
        count = int(count)
        arr = self._buffer[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[
            :count
        ]
        return arr.view(
            arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order)
        )
