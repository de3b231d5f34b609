"""Read a model's config and weights, build the network.

The model is found by `engine.model.source` (a Hugging Face directory, a GGUF file,
`embedded` or a Hub repo id). Both formats yield tensors under Hugging Face names, so the
models load one way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from engine.constants import ACTIVATION_BITS, QUANTIZATION_METHODS
from engine.distributed import get_tp_group
from engine.model.attention.base import AttentionBackend
from engine.model.config import ModelConfig
from engine.model.layers.embedding import VocabParallelEmbedding
from engine.model.layers.linear import CheckpointTensor, Linear, MergedColumnParallelLinear
from engine.model.layers.quantization import (
    BLOCK,
    WeightFormat,
    gguf_format,
    hold_blocks,
    hold_part_blocks,
    quantize_module_int8,
)
from engine.model.models import get_model_class
from engine.model.models.llama import LlamaForCausalLM
from engine.model.source import GGUFReader, ModelSource, resolve_model

logger = logging.getLogger(__name__)

# llama.cpp tensor names -> Hugging Face names. Block tensors are "blk.{i}.{name}.{weight|bias}".
GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
GGUF_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's four norms: llama.cpp's `ffn_norm` is the pre-feed-forward one there.
GGUF_ARCH_BLOCK_TENSORS = {
    "gemma3": {
        **GGUF_BLOCK_TENSORS,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Read into ModelConfig.rope_freq_factors instead of a parameter.
GGUF_CONFIG_TENSORS = {"rope_freqs"}


class Checkpoint(ABC):
    """A model's config and a one-pass stream of its weights under Hugging Face names."""

    config: ModelConfig

    @abstractmethod
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    @abstractmethod
    def num_tensors(self) -> int:
        """How many tensors `weights` yields (the length of the loading progress bar)."""

    def lazy_weights(self) -> Iterator[tuple[str, CheckpointTensor]]:
        """The same stream for the model's loaders, which `narrow` each tensor to their
        rank's slice: formats that can read a slice alone read only that."""
        return self.weights()


class HFCheckpoint(Checkpoint):
    def __init__(self, model_dir: Path):
        self.config = ModelConfig.from_hf(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            self.files = [model_dir / name for name in names]
        else:
            self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(
                f"{model_dir} has no .safetensors weights (other formats are not supported)"
            )

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def num_tensors(self) -> int:
        total = 0
        for file in self.files:  # each file's header only
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
        return total

    def lazy_weights(self) -> Iterator[tuple[str, CheckpointTensor]]:
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, SafetensorsSlice(f.get_slice(name))


class SafetensorsSlice:
    """A tensor of an open safetensors file, read only as far as `narrow` asks: a rank
    reads its shard, not the whole tensor. Valid while the file is open."""

    def __init__(self, tensor_slice: Any):
        self.tensor_slice = tensor_slice
        self.shape = torch.Size(tensor_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        tensor: torch.Tensor = self.tensor_slice[index]
        return tensor


class GGUFCheckpoint(Checkpoint):
    """Tensors read and dequantized to float32 with the `gguf` library, one at a time."""

    def __init__(self, path: Path):
        self.reader = GGUFReader(path)
        self.config = ModelConfig.from_gguf(self.reader)
        arch = self.reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
        self.block_tensors = GGUF_ARCH_BLOCK_TENSORS.get(arch, GGUF_BLOCK_TENSORS)
        # llama.cpp's converter permutes Q and K rows of `llama` files (only) for its rotary layout.
        self.rotary_permuted = arch == "llama"

    def tensor_types(self) -> dict[str, gguf.GGMLQuantizationType]:
        """Each weight's type in the file, under its Hugging Face name."""
        return {
            name: tensor.tensor_type
            for tensor in self.reader.tensors
            if (name := hf_tensor_name(tensor.name, self.block_tensors)) is not None
        }

    def weights(self, blocks: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantized to float32, except the tensors named in `blocks`: those come as the
        file stores them, uint8 rows of blocks (`quantization.hold_blocks`)."""
        config = self.config
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name, self.block_tensors)
            if name is None:
                continue
            if name in blocks:
                rows = int(np.prod(tensor.shape[1:]))
                weight = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))
            else:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
                weight = torch.from_numpy(array if array.flags.writeable else array.copy())
            if self.rotary_permuted and ".q_proj." in name:
                weight = unpermute_rotary(weight, config.num_attention_heads)
            elif self.rotary_permuted and ".k_proj." in name:
                weight = unpermute_rotary(weight, config.num_key_value_heads)
            yield name, weight

    def num_tensors(self) -> int:
        return sum(
            1 for t in self.reader.tensors if hf_tensor_name(t.name, self.block_tensors) is not None
        )


def hf_tensor_name(
    gguf_name: str, block_tensors: Mapping[str, str] = GGUF_BLOCK_TENSORS
) -> str | None:
    """The Hugging Face name of a llama.cpp tensor (a block's under `block_tensors`, its
    architecture's table); None for tensors that are config."""
    parts = gguf_name.split(".")
    if parts[0] in GGUF_CONFIG_TENSORS:
        return None
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in block_tensors:
        return f"model.layers.{parts[1]}.{block_tensors[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_TENSORS:
        return f"{GGUF_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported model")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute`, which reorders each head's rows from the two rotary
    halves (rotate-half layout) to interleaved pairs: `[head, 2, d/2] -> [head, d/2, 2]`."""
    shape = weight.shape
    return (
        weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
        .transpose(1, 2)
        .reshape(shape)
    )


def open_checkpoint(model: str | os.PathLike | ModelSource) -> Checkpoint:
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    return GGUFCheckpoint(source.path) if source.is_gguf else HFCheckpoint(source.path)


def load_model(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    attn_backend: AttentionBackend,
    quantization: str = "none",
    quantized_activations: str = "int16",
) -> LlamaForCausalLM:
    """Build this rank's shard of the network for `checkpoint.config` straight on `device`
    in `dtype` and fill it, with weights held as `quantization` says (see
    `resolve_quantization`); refuse a tensor-parallel size the model cannot be split over.
    Rank 0 shows a progress bar over the tensors on stderr, and each rank logs the time."""
    started = time.perf_counter()
    tp_group = get_tp_group()
    checkpoint.config.verify_tp_size(tp_group.size)
    model_cls = get_model_class(checkpoint.config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(checkpoint.config, attn_backend)
    blocks: set[str] = set()
    if quantization == "gguf":
        if not isinstance(checkpoint, GGUFCheckpoint):
            raise ValueError(
                "--quantization gguf serves a GGUF file's blocks; this model is not one"
            )
        bits = ACTIVATION_BITS[quantized_activations]
        blocks = hold_gguf_blocks(model, checkpoint.tensor_types(), bits)
    total = checkpoint.num_tensors()
    weights = (
        checkpoint.weights(blocks)
        if isinstance(checkpoint, GGUFCheckpoint)
        else checkpoint.lazy_weights()
    )
    with tqdm(
        weights,
        total=total,
        desc="Loading weights",
        unit="tensor",
        file=sys.stderr,
        mininterval=0.5,
        disable=not tp_group.is_first_rank,
    ) as weights:
        model.load_weights(weights)
    if quantization == "int8":
        for module in model.modules():
            if isinstance(module, Linear) and module.input_size % BLOCK == 0:
                quantize_module_int8(module, ACTIVATION_BITS[quantized_activations])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "weights: %d tensors, %.2f GiB on %s, loaded in %.1f s",
        total,
        size / (1 << 30),
        device,
        time.perf_counter() - started,
    )
    return model.eval()


def resolve_quantization(
    quantization: str, checkpoint: Checkpoint, device: torch.device, tp_size: int
) -> str:
    """`auto`: a GGUF file's blocks as stored on CPU at one rank, else none (on CUDA the
    matmul of dequantized weights stays the default, and `gguf` trades it for the blocks'
    memory). `gguf` runs on CPU or CUDA, `int8` on CPU, both at one rank: a rank's shard
    of a row-parallel layer would split blocks. An explicit method the device or group
    cannot serve is refused."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization must be one of {QUANTIZATION_METHODS}, got {quantization!r}"
        )
    if quantization == "auto":
        gguf_file = isinstance(checkpoint, GGUFCheckpoint)
        return "gguf" if gguf_file and device.type == "cpu" and tp_size == 1 else "none"
    devices = ("cpu", "cuda") if quantization == "gguf" else ("cpu",)
    if quantization != "none" and (device.type not in devices or tp_size != 1):
        raise ValueError(
            f"--quantization {quantization} runs on {' or '.join(devices)} with --tp-size 1 "
            f"(here: {device.type}, tp {tp_size}); use --quantization none"
        )
    return quantization


def hold_gguf_blocks(
    model: nn.Module,
    tensor_types: dict[str, gguf.GGMLQuantizationType],
    activation_bits: int,
) -> set[str]:
    """Switch every linear layer and embedding whose checkpoint tensors all come in formats
    the kernels serve (`quantization.gguf_format`) to hold their blocks: one format's, or
    each part's own where a fused layer's parts differ (K-quant files mix them); the names
    of those tensors, which the checkpoint then yields as stored. A layer with any other
    part stays in the model's dtype."""
    parts: dict[str, dict[str | None, tuple[str, WeightFormat | None]]] = {}  # by shard id
    for name, tensor_type in tensor_types.items():
        name_in_model, shard_id = name, None
        for fused, original, shard in getattr(model, "stacked_params_mapping", ()):
            if original in name:
                name_in_model, shard_id = name.replace(original, fused), shard
                break
        parts.setdefault(name_in_model, {})[shard_id] = (name, gguf_format(tensor_type))
    blocks: set[str] = set()
    for param_name, shards in parts.items():
        module_name, _, attr = param_name.rpartition(".")
        formats = {shard_id: f for shard_id, (_, f) in shards.items() if f is not None}
        if attr != "weight" or len(formats) < len(shards):
            continue
        module = model.get_submodule(module_name)
        distinct = set(formats.values())
        if len(distinct) == 1 and isinstance(module, (Linear, VocabParallelEmbedding)):
            hold_blocks(module, distinct.pop(), activation_bits)
        elif isinstance(module, MergedColumnParallelLinear) and (
            formats.keys() == module.shards.keys()
        ):
            hold_part_blocks(module, formats, activation_bits)
        else:
            continue
        blocks.update(name for name, _ in shards.values())
    return blocks


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
