"""Reading one PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into
this rank's slices, padded to `max_lora_rank`, ready to copy into a slot of the stacked
buffers (engine/lora/layers.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.lora.errors import LoRAError
from engine.lora.layers import LoRALayer

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target: each lives in one of our fused or plain layers."""

_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.(lora_[AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter held on the host: per LoRA layer (our module name), its padded A and B for
    this rank (see `LoRALayer.slot_weights`), and the scaling `lora_alpha / r`."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from `adapter_config.json`, refusing what the forward cannot apply."""
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"{config_file} is missing: not a PEFT adapter directory")
    try:
        config: dict[str, Any] = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{config_file} is not valid JSON: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {config.get('peft_type')!r} is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoRAError(f"adapter r ({rank!r}) and lora_alpha ({alpha!r}) must be numbers")
    if rank > max_rank:
        raise LoRAError(f"adapter rank {rank} exceeds --max-lora-rank {max_rank}")
    for unsupported in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(unsupported):
            raise LoRAError(f"adapter option {unsupported} is not supported")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    bad = sorted(set(names) - set(TARGET_MODULES))
    if bad:
        raise LoRAError(f"target_modules {bad} are not supported; supported: {TARGET_MODULES}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def layer_of(module_name: str, stacked: tuple[tuple[str, str, str], ...]) -> tuple[str, str]:
    """(our layer's name, its sub-projection) for a checkpoint projection name."""
    dotted = module_name + "."
    for fused, original, shard_id in stacked:
        if original in dotted:
            return dotted.replace(original, fused)[:-1], shard_id
    return module_name, ""


def load_adapter(
    name: str, path: str, model: nn.Module, layers: dict[str, LoRALayer], max_rank: int
) -> LoRAAdapter:
    """Read and check an adapter against the model's LoRA layers; nothing is touched on
    failure (LoRAError, status 400)."""
    directory = Path(path)
    rank, scaling = read_config(directory, max_rank)
    tensor_file = directory / "adapter_model.safetensors"
    if not tensor_file.is_file():
        raise LoRAError(f"{tensor_file} is missing")
    stacked = getattr(model, "stacked_params_mapping", ())
    pieces: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    try:
        with safe_open(str(tensor_file), framework="pt") as f:
            for key in f.keys():
                match = _TENSOR_NAME.match(key)
                if match is None:
                    raise LoRAError(f"adapter tensor {key!r} is not a LoRA A/B weight")
                module, ab = match.groups()
                if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
                    raise LoRAError(f"adapter tensor {key!r} targets an unsupported module")
                layer_name, sub = layer_of(module, stacked)
                if layer_name not in layers:
                    raise LoRAError(f"adapter tensor {key!r} has no layer in the model")
                pieces.setdefault(layer_name, {}).setdefault(sub, {})[ab] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise LoRAError(f"cannot read {tensor_file}: {e}") from e
    if not pieces:
        raise LoRAError(f"{tensor_file} holds no LoRA weights")
    weights = {
        layer_name: layers[layer_name].slot_weights(subs, rank, key_hint=layer_name)
        for layer_name, subs in pieces.items()
    }
    return LoRAAdapter(name, path, rank, scaling, weights)
