"""Small random PEFT LoRA adapters of a Hugging Face model, made with `peft`, for the tests
that serve adapters."""

from __future__ import annotations

from pathlib import Path


def make_adapter(base: Path, out: Path, rank: int, seed: int, targets: list[str]) -> Path:
    """A PEFT adapter of `base` with random (non-zero) A and B, so it changes the output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out
