"""Attention backends over the paged KV pool (`torch`: portable; `triton`: GPU kernels)."""

from __future__ import annotations

import torch

from engine.model.attention.base import AttentionBackend, AttentionLayer

ATTENTION_BACKENDS = ("torch", "triton")

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionLayer",
    "create_attention_backend",
    "default_attention_backend",
]


def default_attention_backend(device: str | torch.device) -> str:
    """Triton kernels on CUDA, the torch backend elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


def create_attention_backend(
    name: str, *, num_heads: int, num_kv_heads: int, head_dim: int, device: str | torch.device
) -> AttentionBackend:
    """Build a backend by name. Every backend's constructor takes these same keyword
    arguments (`num_heads`, `num_kv_heads`, `head_dim`, `device`), so the runner never
    branches on which one it got. `triton` is imported only when asked for: importing it
    imports Triton."""
    backend_cls: type[AttentionBackend]
    if name == "torch":
        from engine.model.attention.torch_backend import TorchAttnBackend

        backend_cls = TorchAttnBackend
    elif name == "triton":
        from engine.model.attention.triton_backend import TritonAttnBackend

        backend_cls = TritonAttnBackend
    else:
        raise ValueError(
            f"unknown attention backend {name!r} (choose from {', '.join(ATTENTION_BACKENDS)})"
        )
    return backend_cls(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, device=device
    )
