"""Small random LoRA adapters made with peft, and transformers + peft as the reference."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM  # noqa: E402

Reference = Callable[[str | None, list[int], torch.dtype], torch.Tensor]

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, tuple[int, list[str]]] = {
    "attn": (4, ["q_proj", "v_proj"]),
    "mlp": (8, ["gate_proj", "up_proj", "down_proj"]),
    "all": (2, ALL_TARGETS),
}
"""name -> (rank, target modules): different ranks, so slots hold padded adapters."""


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def make_adapter(base: Path, out: Path, seed: int, rank: int, targets: list[str]) -> Path:
    """A PEFT adapter of `base` whose A and B are both random (peft's default B is 0)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    lora_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    lora_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        name: make_adapter(tiny_model_dir, root / name, seed, rank, targets)
        for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapters: dict[str, Path]) -> Reference:
    """`reference(adapter, ids, dtype)`: transformers + peft's last-position logits."""
    models: dict[tuple[str | None, torch.dtype], Any] = {}

    def model(name: str | None, dtype: torch.dtype) -> Any:
        if (name, dtype) not in models:
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()
            models[name, dtype] = (
                base if name is None else peft.PeftModel.from_pretrained(base, adapters[name])
            )
        return models[name, dtype]

    @torch.no_grad()
    def logits(name: str | None, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
        return model(name, dtype)(torch.tensor([ids])).logits[0, -1]

    return logits
